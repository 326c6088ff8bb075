//! Integration tests across ingress, extractor and publisher on real nats-server
//! processes, a real simulated provider and a real webhook receiver.

mod admin;
mod anthropic;
mod auth;
mod chaos;
mod cluster;
mod compose;
mod dead_letters;
mod deadlines;
mod delivery;
mod faults;
mod fencing;
mod findings_v2;
mod harness;
mod idempotency;
mod invalid_argument;
mod kubernetes;
mod large_reviews;
mod lifecycle;
mod list_reviews;
mod manual;
mod nats_auth;
mod pipeline;
mod proto_api;
mod publish_once;
mod quarantine;
mod rate_limits;
mod raw_input;
mod replicas;
mod residency;
mod reviewctl;
mod scenarios;
mod scheduling;
mod surfaces;
mod telemetry;
mod tokens;
