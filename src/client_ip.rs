//! Who the client is (docs/configuration.md#client-address): the TCP peer, unless the peer is a trusted
//! proxy, in which case `X-Forwarded-For` is read from right to left, skipping trusted
//! addresses, and the first untrusted one is the client. A client can therefore never
//! choose its own address by sending `X-Forwarded-For` directly.

use std::borrow::Cow;
use std::net::{IpAddr, SocketAddr};

use http::HeaderMap;
use http::header::HeaderValue;
use ipnet::IpNet;

/// The `server.trusted_proxies` set.
#[derive(Debug, Clone, Default)]
pub(crate) struct TrustedProxies {
    nets: Vec<IpNet>,
}

impl TrustedProxies {
    pub(crate) fn new(nets: Vec<IpNet>) -> Self {
        TrustedProxies { nets }
    }

    pub(crate) fn contains(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.nets.iter().any(|net| net.contains(&ip))
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.nets.is_empty()
    }
}

/// A connection's TCP peer, its address written out once for every request on the
/// connection (the forwarding headers, and the rate-limit key of a client that is the peer).
#[derive(Debug)]
pub(crate) struct Peer {
    /// The TCP peer's address and port.
    pub address: SocketAddr,
    /// The port of the listener that accepted the connection.
    pub local_port: u16,
    /// Whether the connection is TLS (the HTTPS listener).
    pub tls: bool,
    /// The address, IPv4-mapped IPv6 as IPv4.
    pub ip: IpAddr,
    /// `ip` as text.
    pub text: String,
    /// `ip` as a header value.
    pub value: HeaderValue,
}

impl Peer {
    pub(crate) fn new(address: SocketAddr, local_port: u16, tls: bool) -> Self {
        let ip = address.ip().to_canonical();
        let text = ip_text(ip);
        let value = HeaderValue::try_from(text.as_str()).expect("an IP address is a valid header value");
        Peer {
            address,
            local_port,
            tls,
            ip,
            text,
            value,
        }
    }

    /// The listener's scheme, as the access log and traces name it.
    pub(crate) fn scheme(&self) -> &'static str {
        if self.tls { "https" } else { "http" }
    }

    /// `ip` (a client's address) as text: the peer's, already written out, when it is
    /// the peer's.
    pub(crate) fn text_of(&self, ip: IpAddr) -> Cow<'_, str> {
        if ip == self.ip {
            Cow::Borrowed(self.text.as_str())
        } else {
            Cow::Owned(ip_text(ip))
        }
    }
}

/// `ip` as text, exactly as `Display` writes it ([`push_ip_text`]).
pub(crate) fn ip_text(ip: IpAddr) -> String {
    let mut text = String::with_capacity(15);
    push_ip_text(ip, |piece| text.push_str(piece));
    text
}

/// Gives `push` the text of `ip`, exactly as `Display` writes it, piece by piece; IPv4 (the
/// common case, on every request) without the formatting machinery.
pub(crate) fn push_ip_text(ip: IpAddr, mut push: impl FnMut(&str)) {
    match ip {
        IpAddr::V4(v4) => {
            let mut digits = itoa::Buffer::new();
            for (i, octet) in v4.octets().into_iter().enumerate() {
                if i > 0 {
                    push(".");
                }
                push(digits.format(octet));
            }
        }
        IpAddr::V6(v6) => push(&v6.to_string()),
    }
}

/// The client address for a request from `peer` carrying `headers`.
pub(crate) fn client_ip(peer: IpAddr, headers: &HeaderMap, trusted: &TrustedProxies) -> IpAddr {
    let peer = peer.to_canonical();
    if trusted.is_empty() || !trusted.contains(peer) {
        return peer;
    }
    let lines: Vec<&HeaderValue> = headers.get_all("x-forwarded-for").iter().collect();
    let mut client = peer;
    for entry in lines
        .iter()
        .rev()
        .flat_map(|line| line.as_bytes().rsplit(|&b| b == b','))
    {
        match parse_entry(entry) {
            Some(ip) if trusted.contains(ip) => client = ip,
            Some(ip) => return ip,
            // An entry we cannot read: the last trusted hop is the best we know.
            None => return client,
        }
    }
    client
}

/// `1.2.3.4`, `1.2.3.4:5678`, `2001:db8::1` or `[2001:db8::1]:443`, with optional spaces.
fn parse_entry(raw: &[u8]) -> Option<IpAddr> {
    let text = std::str::from_utf8(raw).ok()?.trim();
    text.parse::<IpAddr>()
        .or_else(|_| text.parse::<SocketAddr>().map(|s| s.ip()))
        .ok()
        .map(|ip| ip.to_canonical())
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        #[test]
        fn ip_text_is_what_display_writes(v4: u32, v6: u128) {
            for ip in [IpAddr::from(std::net::Ipv4Addr::from(v4)), IpAddr::from(std::net::Ipv6Addr::from(v6))] {
                proptest::prop_assert_eq!(ip_text(ip), ip.to_string());
            }
        }
    }

    fn headers(xff: &[&str]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for line in xff {
            map.append("x-forwarded-for", HeaderValue::from_str(line).unwrap());
        }
        map
    }

    fn trusted(nets: &[&str]) -> TrustedProxies {
        TrustedProxies::new(nets.iter().map(|n| n.parse().unwrap()).collect())
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn untrusted_peer_is_the_client_whatever_it_sends() {
        let t = trusted(&["10.0.0.0/8"]);
        assert_eq!(
            client_ip(ip("203.0.113.9"), &headers(&["1.2.3.4"]), &t),
            ip("203.0.113.9")
        );
        assert_eq!(
            client_ip(ip("203.0.113.9"), &headers(&["1.2.3.4"]), &trusted(&[])),
            ip("203.0.113.9")
        );
    }

    #[test]
    fn trusted_peer_reads_right_to_left_skipping_trusted_hops() {
        let t = trusted(&["10.0.0.0/8"]);
        let h = headers(&["6.6.6.6, 198.51.100.7", "10.0.0.2"]);
        assert_eq!(client_ip(ip("10.0.0.1"), &h, &t), ip("198.51.100.7"));
    }

    #[test]
    fn all_trusted_gives_the_leftmost_and_no_header_gives_the_peer() {
        let t = trusted(&["10.0.0.0/8"]);
        assert_eq!(
            client_ip(ip("10.0.0.1"), &headers(&["10.0.0.3, 10.0.0.2"]), &t),
            ip("10.0.0.3")
        );
        assert_eq!(client_ip(ip("10.0.0.1"), &headers(&[]), &t), ip("10.0.0.1"));
    }

    #[test]
    fn garbage_stops_at_the_last_trusted_hop() {
        let t = trusted(&["10.0.0.0/8"]);
        assert_eq!(
            client_ip(ip("10.0.0.1"), &headers(&["1.1.1.1, bogus, 10.0.0.5"]), &t),
            ip("10.0.0.5")
        );
    }

    #[test]
    fn ports_brackets_and_mapped_addresses() {
        let t = trusted(&["10.0.0.0/8"]);
        assert_eq!(
            client_ip(ip("::ffff:10.0.0.1"), &headers(&["[2001:db8::1]:443"]), &t),
            ip("2001:db8::1")
        );
        assert_eq!(
            client_ip(ip("10.0.0.1"), &headers(&["192.0.2.1:5678"]), &t),
            ip("192.0.2.1")
        );
        assert_eq!(
            client_ip(ip("::ffff:192.0.2.1"), &headers(&[]), &t),
            ip("192.0.2.1")
        );
    }
}
