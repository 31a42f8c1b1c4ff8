//! Parsers for the value syntaxes of `gateway.toml`: durations, sizes and CIDRs.
//!
//! Each returns a message that completes "expected ..." so the caller can attach it to
//! the key and position of the value.

use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;

/// `"250ms"`, `"2s"`, `"1m"`, `"1h"`, `"1d"` (and combinations such as `"1m30s"`).
pub(crate) fn duration(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text.trim()).map_err(|_| {
        format!("expected a duration such as \"250ms\", \"2s\", \"1m\", \"1h\" or \"1d\", got {text:?}")
    })
}

/// A duration that must be greater than zero.
pub(crate) fn positive_duration(text: &str) -> Result<Duration, String> {
    match duration(text)? {
        d if d.is_zero() => Err(format!("expected a duration greater than zero, got {text:?}")),
        d => Ok(d),
    }
}

/// `"512"`, `"64KB"`, `"10MB"`, `"1GB"`: bytes, with binary (1024-based) multipliers as in
/// nginx; `K`/`KiB`, `M`/`MiB`, `G`/`GiB` are accepted as the same units.
pub(crate) fn size(text: &str) -> Result<u64, String> {
    let expected = || format!("expected a size such as \"512KB\" or \"10MB\", got {text:?}");
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(trimmed.len());
    let (digits, unit) = trimmed.split_at(split);
    let number: u64 = digits.parse().map_err(|_| expected())?;
    let multiplier: u64 = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "K" | "KB" | "KIB" => 1 << 10,
        "M" | "MB" | "MIB" => 1 << 20,
        "G" | "GB" | "GIB" => 1 << 30,
        _ => return Err(expected()),
    };
    number.checked_mul(multiplier).ok_or_else(expected)
}

/// A CIDR such as `"10.0.0.0/8"` or `"fd00::/8"`, or a single address.
pub(crate) fn cidr(text: &str) -> Result<IpNet, String> {
    let trimmed = text.trim();
    trimmed
        .parse::<IpNet>()
        .map(|net| net.trunc())
        .or_else(|_| trimmed.parse::<IpAddr>().map(IpNet::from))
        .map(ipv4_if_mapped)
        .map_err(|_| format!("expected a CIDR such as \"10.0.0.0/8\" or an IP address, got {text:?}"))
}

/// An IPv6 network within `::ffff:0:0/96` as the IPv4 network it maps: client addresses
/// are compared in their canonical form (an IPv4-mapped peer as IPv4), which an IPv6
/// network never contains.
fn ipv4_if_mapped(net: IpNet) -> IpNet {
    match net {
        IpNet::V6(v6) if v6.prefix_len() >= 96 => match v6.addr().to_ipv4_mapped() {
            Some(v4) => IpNet::new_assert(IpAddr::V4(v4), v6.prefix_len() - 96),
            None => net,
        },
        _ => net,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(duration("1m"), Ok(Duration::from_secs(60)));
        assert_eq!(duration("1h"), Ok(Duration::from_secs(3600)));
        assert_eq!(duration("1d"), Ok(Duration::from_secs(86400)));
        assert!(duration("10").is_err());
        assert!(duration("soon").is_err());
        assert!(positive_duration("0s").is_err());
    }

    #[test]
    fn sizes() {
        assert_eq!(size("512"), Ok(512));
        assert_eq!(size("64KB"), Ok(64 * 1024));
        assert_eq!(size("10MB"), Ok(10 * 1024 * 1024));
        assert_eq!(size("1gb"), Ok(1 << 30));
        assert_eq!(size("3MiB"), Ok(3 << 20));
        assert!(size("10XB").is_err());
        assert!(size("MB").is_err());
        assert!(size("-1MB").is_err());
        assert!(size("99999999999999999GB").is_err());
    }

    #[test]
    fn cidrs() {
        assert_eq!(cidr("10.0.0.0/8").unwrap().to_string(), "10.0.0.0/8");
        assert_eq!(cidr("10.1.2.3/8").unwrap().to_string(), "10.0.0.0/8");
        assert_eq!(cidr("192.168.1.1").unwrap().to_string(), "192.168.1.1/32");
        assert_eq!(cidr("::1").unwrap().to_string(), "::1/128");
        assert!(cidr("10.0.0.0/33").is_err());
        assert!(cidr("localhost").is_err());
    }

    #[test]
    fn ipv4_mapped_networks_become_ipv4() {
        assert_eq!(cidr("::ffff:127.0.0.6").unwrap().to_string(), "127.0.0.6/32");
        assert_eq!(cidr("::ffff:10.1.2.3/104").unwrap().to_string(), "10.0.0.0/8");
        assert_eq!(
            cidr("::FFFF:192.168.1.0/120").unwrap().to_string(),
            "192.168.1.0/24"
        );
        assert_eq!(cidr("::ffff:0:0/96").unwrap().to_string(), "0.0.0.0/0");
        // Wider than the mapped range, or outside it: still IPv6.
        assert_eq!(cidr("::ffff:0:0/95").unwrap().to_string(), "::fffe:0:0/95");
        assert_eq!(cidr("::127.0.0.1").unwrap().to_string(), "::7f00:1/128");
        assert_eq!(cidr("fd00::/8").unwrap().to_string(), "fd00::/8");
    }
}
