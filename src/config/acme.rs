//! Validation of `[server.tls.acme]` (docs/configuration.md#servertlsacme): what `floodgate
//! check` can know without contacting the CA — the directory's URL, the names, the contact,
//! the storage directory and the CA file for the directory's TLS.

use std::path::{Path, PathBuf};

use rustls::pki_types::CertificateDer;
use toml::Spanned;

use super::error::ErrorSink;
use super::file::{AcmeFile, EabFile};
use super::parse_spanned;

/// `[server.tls.acme]`: certificates obtained from an ACME (RFC 8555) CA.
#[derive(Debug, Clone, PartialEq)]
pub struct AcmeConfig {
    /// The CA's directory URL (https).
    pub directory: String,
    /// `mailto:` URLs for the account.
    pub contact: Vec<String>,
    /// The names of the one certificate, lower case, in file order, no duplicates.
    pub domains: Vec<String>,
    /// Where the account, keys and certificates are kept without `[redis]`.
    pub storage: Option<PathBuf>,
    /// `ca`: the only roots trusted for the directory's TLS, when given.
    pub ca: Option<Vec<CertificateDer<'static>>>,
    /// `eab`: the External Account Binding some CAs require for a new account.
    pub eab: Option<Eab>,
}

/// An External Account Binding (RFC 8555 §7.3.4): the CA's key ID and HMAC key.
#[derive(Clone, PartialEq)]
pub struct Eab {
    pub kid: String,
    /// Decoded.
    pub hmac_key: Vec<u8>,
}

impl std::fmt::Debug for Eab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Eab")
            .field("kid", &self.kid)
            .field("hmac_key", &"<redacted>")
            .finish()
    }
}

/// At most this many names in one certificate (Let's Encrypt's limit).
const MAX_DOMAINS: usize = 100;

pub(super) fn validate_acme(
    raw: &Spanned<AcmeFile>,
    base: &Path,
    sink: &mut ErrorSink,
) -> Option<AcmeConfig> {
    let raw = raw.get_ref();
    let directory = parse_spanned(&raw.directory, "server.tls.acme.directory", sink, |text| {
        let uri: http::Uri = text.parse().map_err(|_| format!("{text:?} is not a URL"))?;
        match (uri.scheme_str(), uri.authority()) {
            (Some("https"), Some(_)) => Ok(text.to_owned()),
            _ => Err(format!(
                "expected the CA's https:// directory URL (such as \"https://acme-v02.api.letsencrypt.org/directory\"), got {text:?}"
            )),
        }
    });
    let contact = contacts(raw.contact.as_ref(), sink);
    let domains = domains(&raw.domains, sink);
    let storage = raw.storage.as_ref().and_then(|storage| {
        let path = base.join(storage.get_ref());
        parse_spanned(storage, "server.tls.acme.storage", sink, |_| {
            if path.exists() && !path.is_dir() {
                return Err(format!("{}: exists and is not a directory", path.display()));
            }
            Ok(path.clone())
        })
    });
    let ca = match &raw.ca {
        None => Some(None),
        Some(ca) => parse_spanned(ca, "server.tls.acme.ca", sink, |text| {
            let path = base.join(text);
            let roots = super::tls::load_chain(&path)?;
            let mut store = rustls::RootCertStore::empty();
            for root in &roots {
                store
                    .add(root.clone())
                    .map_err(|e| format!("{}: not a usable CA certificate: {e}", path.display()))?;
            }
            Ok(roots)
        })
        .map(Some),
    };
    let eab = match &raw.eab {
        None => Some(None),
        Some(eab) => external_account(eab.get_ref(), sink).map(Some),
    };
    Some(AcmeConfig {
        directory: directory?,
        contact: contact?,
        domains: domains?,
        storage,
        ca: ca?,
        eab: eab?,
    })
}

/// `eab`: the key ID as given, the HMAC key base64url-decoded (with or without padding, as
/// CAs hand it out).
fn external_account(raw: &EabFile, sink: &mut ErrorSink) -> Option<Eab> {
    use base64::Engine as _;
    let kid = parse_spanned(&raw.kid, "server.tls.acme.eab.kid", sink, |text| {
        if text.trim().is_empty() {
            Err("expected the key ID the CA gave".to_owned())
        } else {
            Ok(text.to_owned())
        }
    });
    let hmac_key = parse_spanned(&raw.hmac_key, "server.tls.acme.eab.hmac_key", sink, |text| {
        base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(text.trim_end_matches('='))
            .ok()
            .filter(|key| !key.is_empty())
            .ok_or_else(|| "expected the HMAC key the CA gave, base64url-encoded".to_owned())
    });
    Some(Eab {
        kid: kid?,
        hmac_key: hmac_key?,
    })
}

/// `contact`: one `mailto:` URL or a list of them.
fn contacts(raw: Option<&Spanned<toml::Value>>, sink: &mut ErrorSink) -> Option<Vec<String>> {
    let Some(raw) = raw else {
        return Some(Vec::new());
    };
    let texts: Option<Vec<&str>> = match raw.get_ref() {
        toml::Value::String(one) => Some(vec![one.as_str()]),
        toml::Value::Array(many) => many.iter().map(toml::Value::as_str).collect(),
        _ => None,
    };
    let valid = texts.filter(|texts| {
        texts.iter().all(|text| {
            text.strip_prefix("mailto:")
                .is_some_and(|address| address.contains('@') && !address.contains([',', ' ']))
        })
    });
    if valid.is_none() {
        sink.push(
            Some(raw.span()),
            "server.tls.acme.contact",
            "expected a \"mailto:ADDRESS\" URL, or a list of them",
        );
    }
    valid.map(|texts| texts.into_iter().map(str::to_owned).collect())
}

/// `domains`: DNS names that http-01 or tls-alpn-01 can prove (no wildcard, no address).
fn domains(raw: &Spanned<Vec<Spanned<String>>>, sink: &mut ErrorSink) -> Option<Vec<String>> {
    let list = raw.get_ref();
    if list.is_empty() || list.len() > MAX_DOMAINS {
        sink.push(
            Some(raw.span()),
            "server.tls.acme.domains",
            format!("expected 1 to {MAX_DOMAINS} names"),
        );
        return None;
    }
    let mut names: Vec<String> = Vec::with_capacity(list.len());
    let mut valid = true;
    for (i, name) in list.iter().enumerate() {
        let key = format!("server.tls.acme.domains[{i}]");
        match parse_spanned(name, &key, sink, dns_name) {
            Some(name) if names.contains(&name) => {
                sink.push(Some(list[i].span()), key, format!("{name:?} is listed twice"));
                valid = false;
            }
            Some(name) => names.push(name),
            None => valid = false,
        }
    }
    valid.then_some(names)
}

/// A DNS name a CA can validate over HTTP or TLS, lower case.
fn dns_name(text: &str) -> Result<String, String> {
    if text.starts_with("*.") {
        return Err(format!(
            "{text:?}: a wildcard name needs the dns-01 challenge, which floodgate does not answer; use a certificate file for it"
        ));
    }
    if text.parse::<std::net::IpAddr>().is_ok() {
        return Err(format!("{text:?}: expected a DNS name, not an address"));
    }
    let name = text.strip_suffix('.').unwrap_or(text).to_ascii_lowercase();
    let label_ok = |label: &str| {
        (1..=63).contains(&label.len())
            && !label.starts_with('-')
            && !label.ends_with('-')
            && label.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    };
    if name.len() > 253 || !name.contains('.') || !name.split('.').all(label_ok) {
        return Err(format!(
            "{text:?}: expected a DNS name of two or more labels (letters, digits, '-'; IDNs in their xn-- form)"
        ));
    }
    Ok(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_a_ca_can_validate() {
        assert_eq!(dns_name("WWW.Example.com.").unwrap(), "www.example.com");
        assert_eq!(
            dns_name("xn--bcher-kva.example").unwrap(),
            "xn--bcher-kva.example"
        );
        for bad in [
            "*.example.com",
            "localhost",
            "127.0.0.1",
            "::1",
            "a..b",
            "-a.example",
            "a_b.example",
            "exa mple.com",
            "",
        ] {
            assert!(dns_name(bad).is_err(), "{bad:?}");
        }
    }
}
