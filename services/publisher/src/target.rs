//! Where a webhook may point. Tenants name their own URLs, so a URL is untrusted input:
//! without a check, a tenant could make the publisher call loopback services, the
//! cluster's private network or a cloud metadata endpoint. Such targets are refused
//! unless the tenant's config allows them (`allow_private_webhook`, for local stacks).
//!
//! The check is applied twice: to the addresses a host resolves to before a delivery
//! (a refusal is a failed delivery with its reason), and inside the HTTP client's
//! resolver (so a name that re-resolves to a forbidden address between the two is never
//! connected to).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

/// Addresses a webhook must not reach without the tenant's permission: loopback,
/// private, shared (CGNAT), link-local (cloud metadata lives at 169.254.169.254),
/// unique-local IPv6 (AWS' IPv6 metadata at fd00:ec2::254), unspecified, broadcast and
/// multicast.
pub fn is_forbidden(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => forbidden_v4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => forbidden_v4(v4),
            None => forbidden_v6(v6),
        },
    }
}

fn forbidden_v4(ip: Ipv4Addr) -> bool {
    let [a, b, ..] = ip.octets();
    ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local()
        || ip.is_unspecified()
        || ip.is_broadcast()
        || ip.is_multicast()
        || a == 0
        // 100.64.0.0/10: shared address space (carrier-grade NAT, some metadata services).
        || (a == 100 && (64..128).contains(&b))
}

fn forbidden_v6(ip: Ipv6Addr) -> bool {
    let first = ip.segments()[0];
    ip.is_loopback()
        || ip.is_unspecified()
        || ip.is_multicast()
        // fc00::/7 unique local, fe80::/10 link-local.
        || (first & 0xfe00) == 0xfc00
        || (first & 0xffc0) == 0xfe80
}

/// The HTTP client's resolver for tenants without `allow_private_webhook`: it drops
/// forbidden addresses, so nothing connects to them whatever a name resolves to later.
pub struct PublicOnly;

impl reqwest::dns::Resolve for PublicOnly {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let host = name.as_str().to_string();
        Box::pin(async move {
            let addrs: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.filter(|a| !is_forbidden(a.ip())).collect();
            if addrs.is_empty() {
                return Err("webhook host resolves to no allowed address".into());
            }
            Ok(Box::new(addrs.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

/// Whether `url`'s host is an allowed target: an IP literal is checked as it is; a name
/// is resolved and refused if any address it has is forbidden.
pub async fn allowed(url: &reqwest::Url) -> bool {
    let Some(host) = url.host() else { return false };
    match host {
        url::Host::Ipv4(ip) => !is_forbidden(IpAddr::V4(ip)),
        url::Host::Ipv6(ip) => !is_forbidden(IpAddr::V6(ip)),
        url::Host::Domain(name) => {
            let port = url.port_or_known_default().unwrap_or(443);
            match tokio::net::lookup_host((name, port)).await {
                Ok(addrs) => {
                    let addrs: Vec<_> = addrs.collect();
                    !addrs.is_empty() && addrs.iter().all(|a| !is_forbidden(a.ip()))
                }
                // Unresolvable now: the delivery fails as a connection error and is retried.
                Err(_) => true,
            }
        }
    }
}

pub fn resolver() -> Arc<PublicOnly> {
    Arc::new(PublicOnly)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn loopback_private_link_local_and_metadata_addresses_are_forbidden() {
        for s in [
            "127.0.0.1",
            "127.8.9.10",
            "10.1.2.3",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "169.254.169.254",
            "100.100.100.200",
            "0.0.0.0",
            "255.255.255.255",
            "224.0.0.1",
            "::1",
            "::",
            "fe80::1",
            "fd00:ec2::254",
            "fc00::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "ff02::1",
        ] {
            assert!(is_forbidden(ip(s)), "{s}");
        }
    }

    #[test]
    fn public_addresses_are_allowed() {
        for s in ["8.8.8.8", "1.1.1.1", "172.32.0.1", "100.128.0.1", "2606:4700::1111", "::ffff:8.8.8.8"] {
            assert!(!is_forbidden(ip(s)), "{s}");
        }
    }

    #[tokio::test]
    async fn ip_literals_are_judged_without_any_lookup() {
        assert!(!allowed(&"http://127.0.0.1:9/hook".parse().unwrap()).await);
        assert!(!allowed(&"http://[::1]:9/hook".parse().unwrap()).await);
        assert!(!allowed(&"http://169.254.169.254/latest".parse().unwrap()).await);
        assert!(allowed(&"https://203.0.113.7/hook".parse().unwrap()).await);
    }
}
