//! The request's host as routes, limit keys, override entries and certificates read it.

/// The request host as routes compare it: without port and trailing dot, lower-case.
/// Returns `None` for a missing or empty host. Allocates only for upper-case input.
pub fn normalize_host(raw: &str) -> Option<std::borrow::Cow<'_, str>> {
    let bytes = raw.as_bytes();
    let without_port = if bytes.first() == Some(&b'[') {
        // An IPv6 literal: "[::1]:8080" → "[::1]".
        bytes
            .iter()
            .position(|&b| b == b']')
            .map_or(raw, |end| &raw[..=end])
    } else {
        bytes
            .iter()
            .rposition(|&b| b == b':')
            .map_or(raw, |colon| &raw[..colon])
    };
    let host = without_port.trim_end_matches('.');
    if host.is_empty() {
        None
    } else if host.bytes().any(|b| b.is_ascii_uppercase()) {
        Some(std::borrow::Cow::Owned(host.to_ascii_lowercase()))
    } else {
        Some(std::borrow::Cow::Borrowed(host))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_are_normalized() {
        assert_eq!(
            normalize_host("API.Example.com:8080").as_deref(),
            Some("api.example.com")
        );
        assert_eq!(normalize_host("example.com.").as_deref(), Some("example.com"));
        assert_eq!(normalize_host("[::1]:80").as_deref(), Some("[::1]"));
        assert_eq!(normalize_host("[::1]").as_deref(), Some("[::1]"));
        assert_eq!(normalize_host(":80"), None);
        assert_eq!(normalize_host(""), None);
    }
}
