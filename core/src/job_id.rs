//! Job ids: `<region>_<32 hex>`, derived from (tenant, idempotency key) so a retry lands
//! on the same job, with the region as prefix so look-ups need no global store.

use sha2::{Digest, Sha256};

use crate::region::Region;

pub fn derive(region: Region, tenant: &str, idempotency_key: &str) -> String {
    let mut h = Sha256::new();
    h.update(tenant.as_bytes());
    h.update([0u8]);
    h.update(idempotency_key.as_bytes());
    let digest = h.finalize();
    format!("{}_{}", region.as_str(), hex::encode(&digest[..16]))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("malformed job id (expected `us_` or `eu_` followed by 32 hex digits)")]
pub struct MalformedJobId;

/// The region a job id belongs to, checking the whole id's shape.
pub fn region_of(job_id: &str) -> Result<Region, MalformedJobId> {
    let (prefix, rest) = job_id.split_once('_').ok_or(MalformedJobId)?;
    if rest.len() != 32 || !rest.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
        return Err(MalformedJobId);
    }
    match prefix {
        "us" => Ok(Region::Us),
        "eu" => Ok(Region::Eu),
        _ => Err(MalformedJobId),
    }
}

/// sha256 hex of some bytes.
pub fn sha256_hex(parts: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_be_bytes());
        h.update(p);
    }
    hex::encode(h.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_region_prefixed_and_tenant_scoped() {
        let a = derive(Region::Eu, "t1", "k");
        assert_eq!(a, derive(Region::Eu, "t1", "k"));
        assert!(a.starts_with("eu_"));
        assert_eq!(a.len(), 3 + 32);
        assert_ne!(a, derive(Region::Eu, "t2", "k"));
        assert_ne!(a, derive(Region::Eu, "t1", "k2"));
        // No ambiguity between ("ab","c") and ("a","bc").
        assert_ne!(derive(Region::Us, "ab", "c"), derive(Region::Us, "a", "bc"));
        assert_eq!(region_of(&a), Ok(Region::Eu));
        assert_eq!(region_of(&derive(Region::Us, "t", "k")), Ok(Region::Us));
    }

    #[test]
    fn rejects_malformed_ids() {
        for bad in [
            "",
            "eu",
            "eu_",
            "xx_0123456789abcdef0123456789abcdef",
            "eu_0123",
            "eu_0123456789ABCDEF0123456789abcdef",
            "eu_0123456789abcdef0123456789abcde.",
        ] {
            assert_eq!(region_of(bad), Err(MalformedJobId), "{bad}");
        }
    }
}
