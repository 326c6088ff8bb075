//! Regions and lanes: the two closed sets every name, subject and label is built from.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A data-residency region. Content of one region never reaches another's NATS or
/// provider endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, PartialOrd, Ord)]
#[serde(rename_all = "lowercase")]
pub enum Region {
    Us,
    Eu,
}

impl Region {
    pub const ALL: [Region; 2] = [Region::Us, Region::Eu];

    /// Lower case, as used in subjects and job id prefixes: `us`, `eu`.
    pub fn as_str(self) -> &'static str {
        match self {
            Region::Us => "us",
            Region::Eu => "eu",
        }
    }

    /// Upper case, as used in stream and bucket names: `US`, `EU`.
    pub fn upper(self) -> &'static str {
        match self {
            Region::Us => "US",
            Region::Eu => "EU",
        }
    }
}

impl fmt::Display for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("unknown region (expected `us` or `eu`)")]
pub struct UnknownRegion;

impl FromStr for Region {
    type Err = UnknownRegion;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "us" => Ok(Region::Us),
            "eu" => Ok(Region::Eu),
            _ => Err(UnknownRegion),
        }
    }
}

/// A lane: interactive and batch work never share a backlog.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Lane {
    Interactive,
    Batch,
}

impl Lane {
    pub const ALL: [Lane; 2] = [Lane::Interactive, Lane::Batch];

    pub fn as_str(self) -> &'static str {
        match self {
            Lane::Interactive => "interactive",
            Lane::Batch => "batch",
        }
    }

    pub fn upper(self) -> &'static str {
        match self {
            Lane::Interactive => "INTERACTIVE",
            Lane::Batch => "BATCH",
        }
    }
}

impl fmt::Display for Lane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn region_round_trips_and_rejects_others() {
        for r in Region::ALL {
            assert_eq!(r.as_str().parse::<Region>(), Ok(r));
            assert_eq!(r.upper().parse::<Region>(), Ok(r));
        }
        assert_eq!("apac".parse::<Region>(), Err(UnknownRegion));
        assert_eq!("".parse::<Region>(), Err(UnknownRegion));
    }
}
