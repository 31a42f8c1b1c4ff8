//! Automatic HTTPS (docs/operations.md#https) against a real ACME CA: Debian's pebble,
//! whose DNS answers every name with 127.0.0.1, validating on the gateway's listeners.
//! A certificate over http-01 (before routing, deny lists and redirect_http) and over
//! tls-alpn-01 when http-01 fails, served by SNI; kept on disk and served again after a
//! restart without an order; a reload that adds a name, from a CA that forgot the account;
//! renewal of pebble's short-lived certificates without a restart, and earlier when the
//! CA's renewal information (ARI, added in front of pebble 2.4, which has none) says so;
//! instances sharing Redis that order once, the CA reaching another instance than the one
//! ordering, with a flood of made-up tokens beside the CA's request; a CA that is down
//! at start.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::common::free_port;
use crate::common::pebble::Pebble;
use crate::common::redis_server::RedisServer;
use crate::common::tls::{TestCa, unverified_client};
use crate::common::{TestGateway, closed_port, get, send};
use floodgate::Config;
use floodgate::reload::Reloader;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

const CONTACT: &str = "mailto:ops@example.com";

/// A gateway's configuration: plain listener on `listen`, TLS on `tls` (with `tls_keys`),
/// ACME for `domains` from `directory` trusting `ca_file` (with `acme_keys`), one route
/// under `/app`, and `more` tables. Port 0 is any.
#[derive(Default, Clone)]
struct Site<'a> {
    listen: u16,
    tls: u16,
    directory: String,
    ca_file: PathBuf,
    domains: &'a [&'a str],
    tls_keys: &'a str,
    acme_keys: String,
    more: String,
}

impl<'a> Site<'a> {
    /// For `domains` from `pebble`, kept on disk under its directory.
    fn on(pebble: &Pebble, domains: &'a [&'a str]) -> Site<'a> {
        Site {
            directory: pebble.directory(),
            ca_file: pebble.ca_file.clone(),
            domains,
            acme_keys: storage(&pebble.dir().join("acme-storage")),
            ..Site::default()
        }
    }

    fn toml(&self) -> String {
        let domains: Vec<String> = self.domains.iter().map(|d| format!("\"{d}\"")).collect();
        format!(
            r#"[server]
listen = "127.0.0.1:{listen}"
admin_listen = "127.0.0.1:0"
header_timeout = "2s"

[server.tls]
listen = "127.0.0.1:{tls}"
{tls_keys}

[server.tls.acme]
directory = "{directory}"
contact = "{CONTACT}"
domains = [{domains}]
ca = "{ca}"
{acme_keys}

[[routes]]
name = "app"
path_prefix = "/app"
respond = {{ status = 200, body = "app\n" }}
{more}
"#,
            listen = self.listen,
            tls = self.tls,
            tls_keys = self.tls_keys,
            directory = self.directory,
            domains = domains.join(", "),
            ca = self.ca_file.display(),
            acme_keys = self.acme_keys,
            more = self.more,
        )
    }
}

/// `storage = "PATH"`.
fn storage(path: &Path) -> String {
    format!("storage = \"{}\"", path.display())
}

/// The certificate presented to a client asking for `name`, or `None` when the handshake
/// fails.
async fn presented(
    connector: &TlsConnector,
    addr: std::net::SocketAddr,
    name: &str,
) -> Option<CertificateDer<'static>> {
    let tcp = TcpStream::connect(addr).await.ok()?;
    let name = ServerName::try_from(name.to_owned()).unwrap();
    let stream = connector.connect(name, tcp).await.ok()?;
    Some(stream.get_ref().1.peer_certificates()?[0].clone().into_owned())
}

/// A client trusting pebble's root, that waits for what the gateway serves.
struct Trusting<'a> {
    connector: TlsConnector,
    pebble: &'a Pebble,
}

impl Trusting<'_> {
    async fn new(pebble: &Pebble) -> Trusting<'_> {
        Trusting {
            connector: pebble.client().await,
            pebble,
        }
    }

    /// Waits up to `limit` for a trusted certificate for `name` at `addr`.
    async fn certificate(
        &self,
        addr: std::net::SocketAddr,
        name: &str,
        limit: Duration,
    ) -> CertificateDer<'static> {
        self.certificate_where(addr, name, limit, |_| true).await
    }

    /// Waits up to `limit` for a trusted certificate for `name` at `addr` that `accept`s.
    async fn certificate_where(
        &self,
        addr: std::net::SocketAddr,
        name: &str,
        limit: Duration,
        accept: impl Fn(&CertificateDer<'static>) -> bool,
    ) -> CertificateDer<'static> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(certificate) = presented(&self.connector, addr, name).await
                && accept(&certificate)
            {
                return certificate;
            }
            assert!(
                Instant::now() < deadline,
                "no certificate for {name} within {limit:?}; pebble's log:\n{}",
                self.pebble.log()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The DNS names and notAfter of `certificate`.
fn facts(certificate: &CertificateDer<'_>) -> (Vec<String>, i64) {
    let (_, parsed) = x509_parser::parse_x509_certificate(certificate).unwrap();
    let names = parsed
        .subject_alternative_name()
        .unwrap()
        .unwrap()
        .value
        .general_names
        .iter()
        .filter_map(|name| match name {
            x509_parser::extensions::GeneralName::DNSName(dns) => Some(dns.to_string()),
            _ => None,
        })
        .collect();
    (names, parsed.validity().not_after.timestamp())
}

/// Reloads `gateway` from the file at `path`, which must load.
async fn reload(gateway: &TestGateway, path: &std::path::Path) {
    let path = path.to_owned();
    let reloader = Reloader::new(gateway.shared.clone(), Box::new(move || Config::load(&path)));
    assert!(
        tokio::task::spawn_blocking(move || reloader.reload("test"))
            .await
            .unwrap()
    );
}

async fn orders(gateway: &TestGateway, result: &str) -> f64 {
    gateway
        .metric(&format!("floodgate_acme_orders_total{{result=\"{result}\"}}"))
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http01_certificate_before_routing_deny_and_redirect_kept_on_disk_and_reloaded_from_a_forgetful_ca() {
    let (http, tls) = (free_port(), free_port());
    let mut pebble = Pebble::start(http, closed_port(), None);
    let stored = pebble.dir().join("acme-storage");
    let (directory, ca_file) = (pebble.directory(), pebble.ca_file.clone());
    let path = pebble.dir().join("gateway.toml");
    let toml = |domains: &[&str]| {
        Site {
            listen: http,
            tls,
            directory: directory.clone(),
            ca_file: ca_file.clone(),
            domains,
            tls_keys: "redirect_http = true",
            acme_keys: storage(&stored),
            ..Site::default()
        }
        .toml()
        // Every client is denied: the CA is answered before that.
        .replace(
            "header_timeout = \"2s\"",
            "header_timeout = \"2s\"\ndeny = [\"127.0.0.0/8\"]",
        )
    };
    std::fs::write(&path, toml(&["a.test", "b.test"])).unwrap();
    let gateway = TestGateway::start_config(Config::load(&path).unwrap()).await;
    let tls_addr = gateway.tls.unwrap();
    let client = Trusting::new(&pebble).await;
    let first = client
        .certificate(tls_addr, "b.test", Duration::from_secs(20))
        .await;
    let (mut names, not_after) = facts(&first);
    names.sort();
    assert_eq!(names, ["a.test", "b.test"]);
    assert_eq!(
        presented(&client.connector, tls_addr, "a.test").await.as_ref(),
        Some(&first)
    );
    assert_eq!(orders(&gateway, "ok").await, 1.0);
    assert_eq!(orders(&gateway, "error").await, 0.0);
    // Published a moment after the certificate is served (a loaded machine can put a
    // handshake and a scrape in that moment).
    let expiry = "floodgate_tls_certificate_expiry_timestamp_seconds{certificate=\"a.test\"}";
    gateway
        .metric_becomes(expiry, not_after as f64, Duration::from_secs(5))
        .await;
    // A token nobody published for one of the names: 404, not the deny list's 403 or the
    // redirect. For another host, or not a token, the path is routed as any other (and
    // redirected here, as every request on the plain listener).
    let token = "/.well-known/acme-challenge/LoqXcYV8q5ONbJQxbmR7SCTNo3tiAXDfowyjxAjEuX0";
    for (host, path, expected) in [
        ("A.test.", token, 404),
        ("app.example", token, 308),
        ("a.test", "/.well-known/acme-challenge/x", 308),
    ] {
        let (status, _, _) = send(
            http::Request::get(gateway.url(path))
                .header("host", host)
                .body(http_body_util::Full::default())
                .unwrap(),
        )
        .await;
        assert_eq!(status, expected, "{host}{path}");
    }
    // Kept on disk, privately.
    use std::os::unix::fs::PermissionsExt as _;
    assert_eq!(
        std::fs::metadata(&stored).unwrap().permissions().mode() & 0o777,
        0o700
    );

    // Started again: the stored certificate is served, nothing ordered.
    let mut gateway = gateway;
    gateway.shutdown().await.unwrap();
    drop(gateway);
    // Its listeners close as its aborted tasks are dropped, a moment later on a busy
    // machine: the new gateway binds the same ports once they are free.
    let deadline = Instant::now() + Duration::from_secs(5);
    while [http, tls]
        .iter()
        .any(|&port| std::net::TcpListener::bind(("127.0.0.1", port)).is_err())
    {
        assert!(
            Instant::now() < deadline,
            "the stopped gateway's ports stay taken"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let gateway = TestGateway::start_config(Config::load(&path).unwrap()).await;
    let again = client
        .certificate(gateway.tls.unwrap(), "a.test", Duration::from_secs(5))
        .await;
    assert_eq!(again, first);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        orders(&gateway, "ok").await + orders(&gateway, "error").await,
        0.0
    );

    // A reload that changes the table but not its set of names (their order): the stored
    // certificate is the one served, and nothing is ordered.
    std::fs::write(&path, toml(&["b.test", "a.test"])).unwrap();
    reload(&gateway, &path).await;
    // An order pebble completes takes about a second.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        orders(&gateway, "ok").await + orders(&gateway, "error").await,
        0.0
    );
    assert_eq!(
        presented(&client.connector, gateway.tls.unwrap(), "b.test")
            .await
            .as_ref(),
        Some(&first)
    );

    // A reload that adds a name orders for the new set, from a CA that forgot the stored
    // account (pebble restarted): a new account is made.
    pebble.restart();
    let client = Trusting::new(&pebble).await;
    std::fs::write(&path, toml(&["a.test", "b.test", "c.test"])).unwrap();
    reload(&gateway, &path).await;
    // Meanwhile the previous certificate goes on serving its names (it is not trusted by
    // the restarted pebble's root: see it unchecked).
    let meanwhile = presented(&unverified_client(&[b"http/1.1"]), gateway.tls.unwrap(), "a.test")
        .await
        .expect("a certificate for a.test right after the reload");
    assert!(meanwhile == first || facts(&meanwhile).0.contains(&"c.test".to_owned()));
    let widened = client
        .certificate_where(
            gateway.tls.unwrap(),
            "c.test",
            Duration::from_secs(20),
            |certificate| facts(certificate).0.contains(&"c.test".to_owned()),
        )
        .await;
    assert_ne!(widened, first);
    // The reload replaced the expiry series; the ACME certificate's is the one served (set
    // right after it is put in service).
    gateway
        .metric_becomes(expiry, facts(&widened).1 as f64, Duration::from_secs(5))
        .await;
    assert_eq!(
        presented(&client.connector, gateway.tls.unwrap(), "a.test").await,
        Some(widened)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_alpn01_proves_the_names_whose_http01_fails_in_the_same_attempt() {
    let tls = free_port();
    // pebble's http-01 goes to a port nobody listens on.
    let pebble = Pebble::start(closed_port(), tls, None);
    let names = ["alpn.test", "b.alpn.test", "c.alpn.test"];
    let gateway = TestGateway::start(
        Site {
            tls,
            ..Site::on(&pebble, &names)
        }
        .toml(),
    )
    .await;
    let client = Trusting::new(&pebble).await;
    let certificate = client
        .certificate(gateway.tls.unwrap(), "alpn.test", Duration::from_secs(30))
        .await;
    assert_eq!(facts(&certificate).0, names);
    assert_eq!(orders(&gateway, "ok").await, 1.0, "one attempt, two orders");
    assert_eq!(orders(&gateway, "error").await, 0.0);
    // A tls-alpn-01 handshake for a name with no pending challenge is refused.
    let probe = unverified_client(&[b"acme-tls/1"]);
    assert_eq!(presented(&probe, gateway.tls.unwrap(), "alpn.test").await, None);
    assert_eq!(presented(&probe, gateway.tls.unwrap(), "other.test").await, None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ca_requiring_external_account_binding_gets_it() {
    const KID: &str = "kid-1";
    const KEY: &str = "zWNDZM6eQGHWpSRTPal5eIUYFTu7EajVIoguysqZ9wG44nMEtx3MUAsUDkMTQ12W";
    let http = free_port();
    let pebble = Pebble::start_requiring_eab(http, closed_port(), (KID, KEY));
    let site = |listen: u16, eab: &str, storage_dir: &str| Site {
        listen,
        acme_keys: format!("{}\n{eab}", storage(&pebble.dir().join(storage_dir))),
        ..Site::on(&pebble, &["eab.test"])
    };
    // Without the binding the CA refuses the account: an error, counted.
    let unbound = TestGateway::start(site(0, "", "unbound").toml()).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while orders(&unbound, "error").await < 1.0 {
        assert!(Instant::now() < deadline, "the refused account was not counted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(unbound);
    let gateway = TestGateway::start(
        site(
            http,
            &format!("eab = {{ kid = \"{KID}\", hmac_key = \"{KEY}\" }}"),
            "bound",
        )
        .toml(),
    )
    .await;
    let client = Trusting::new(&pebble).await;
    let certificate = client
        .certificate(gateway.tls.unwrap(), "eab.test", Duration::from_secs(20))
        .await;
    assert_eq!(facts(&certificate).0, ["eab.test"]);
    assert_eq!(orders(&gateway, "ok").await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_lived_certificates_are_renewed_without_a_restart() {
    let (http, tls) = (free_port(), free_port());
    let pebble = Pebble::start(http, tls, Some(Duration::from_secs(9)));
    let gateway = TestGateway::start(
        Site {
            listen: http,
            tls,
            ..Site::on(&pebble, &["renew.test"])
        }
        .toml(),
    )
    .await;
    let client = Trusting::new(&pebble).await;
    let addr = gateway.tls.unwrap();
    let first = client
        .certificate(addr, "renew.test", Duration::from_secs(20))
        .await;
    // Renewed at two thirds of its 9 s: some 6 s after it was issued.
    let second = client
        .certificate_where(addr, "renew.test", Duration::from_secs(20), |c| *c != first)
        .await;
    assert!(facts(&second).1 > facts(&first).1);
    assert!(orders(&gateway, "ok").await >= 2.0);
    assert_eq!(orders(&gateway, "error").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cas_renewal_information_brings_a_renewal_forward() {
    let (http, tls) = (free_port(), free_port());
    let pebble = Pebble::start(http, tls, Some(Duration::from_secs(30)));
    // The CA's renewal window has passed: renew now.
    let front = pebble
        .ari_front(|| {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs() as i64;
            (now - 60, now - 1)
        })
        .await;
    let gateway = TestGateway::start(
        Site {
            listen: http,
            tls,
            directory: front.directory(),
            ..Site::on(&pebble, &["ari.test"])
        }
        .toml(),
    )
    .await;
    let client = Trusting::new(&pebble).await;
    let addr = gateway.tls.unwrap();
    let first = client
        .certificate(addr, "ari.test", Duration::from_secs(20))
        .await;
    let issued = Instant::now();
    client
        .certificate_where(addr, "ari.test", Duration::from_secs(30), |c| *c != first)
        .await;
    // Two thirds of the 30 s lifetime would be 20 s; after an order floodgate waits a
    // third of the lifetime at least (10 s), then follows the CA's window.
    let after = issued.elapsed();
    assert!(after < Duration::from_secs(17), "renewed after {after:?}");
    assert!(front.asked.load(std::sync::atomic::Ordering::SeqCst) >= 1);
    assert_eq!(orders(&gateway, "error").await, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_sharing_redis_order_once_and_answer_each_others_challenges() {
    let redis = RedisServer::start();
    // pebble reaches instance A alone (its http-01 port); B's listeners are elsewhere.
    let http_a = free_port();
    let pebble = Pebble::start(http_a, closed_port(), None);
    let toml = |listen: u16| {
        Site {
            listen,
            // Kept in Redis: storage is ignored with [redis].
            acme_keys: String::new(),
            more: format!("[redis]\nurl = \"{}\"", redis.url()),
            ..Site::on(&pebble, &["shared.test"])
        }
        .toml()
    };
    // The ordering lock, held by someone else for 2 s: A, starting now, finds it taken and
    // looks again 5 s later; B, started once it is free, takes it and orders, and pebble's
    // validation reaches A, which answers with what B published in Redis.
    let lock = format!(
        "floodgate:acme:lock:{}",
        set_id(&pebble.directory(), &["shared.test"])
    );
    assert_eq!(redis.cli(&["SET", &lock, "someone", "PX", "2000"]).trim(), "OK");
    let a = TestGateway::start(toml(http_a)).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while redis.cli(&["EXISTS", &lock]).trim() == "1" {
        assert!(Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let b = TestGateway::start(toml(0)).await;
    let client = Trusting::new(&pebble).await;
    let from_b = client
        .certificate(b.tls.unwrap(), "shared.test", Duration::from_secs(20))
        .await;
    assert_eq!(orders(&b, "ok").await, 1.0);
    // A serves the same certificate within its 5 s look at storage, without ordering.
    let from_a = client
        .certificate(a.tls.unwrap(), "shared.test", Duration::from_secs(7))
        .await;
    assert_eq!(from_a, from_b);
    assert_eq!(orders(&a, "ok").await + orders(&a, "error").await, 0.0);
    // A third instance, started now, serves it from its first handshake and orders nothing.
    let c = TestGateway::start(toml(0)).await;
    let from_c = presented(&client.connector, c.tls.unwrap(), "shared.test").await;
    assert_eq!(from_c, Some(from_b));
    // Requests go through the handshake that reads the ClientHello first as through any.
    let tcp = TcpStream::connect(c.tls.unwrap()).await.unwrap();
    let stream = client
        .connector
        .connect(ServerName::try_from("shared.test").unwrap(), tcp)
        .await
        .unwrap();
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(connection);
    let response = sender
        .send_request(
            http::Request::get("/app/x")
                .header("host", "shared.test")
                .body(http_body_util::Empty::<bytes::Bytes>::new())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(orders(&c, "ok").await + orders(&c, "error").await, 0.0);
    // The account (and the contacts it gave the CA), the certificate and its key live in
    // Redis without a TTL; nothing else of ACME's stays.
    let keys = redis.cli(&["KEYS", "floodgate:acme:*"]);
    let mut kinds: Vec<&str> = keys.lines().map(|k| k.split(':').nth(2).unwrap()).collect();
    kinds.sort();
    assert_eq!(kinds, ["account", "account-contact", "certificate"], "{keys}");
    for key in keys.lines() {
        assert_eq!(redis.cli(&["TTL", key]).trim(), "-1", "{key}");
    }
}

/// A flood of made-up http-01 tokens, while storage is slow to answer, takes no room from
/// the CA's own request on an instance that answers from Redis: every lookup waits for
/// one read of what the instances published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_made_up_tokens_does_not_turn_the_cas_request_away() {
    let redis = RedisServer::start();
    let pebble = Pebble::start(closed_port(), closed_port(), None);
    let site = Site {
        acme_keys: String::new(),
        more: format!("[redis]\nurl = \"{}\"", redis.url()),
        ..Site::on(&pebble, &["flood.test"])
    };
    // Another instance orders, and has published the answer to `token`.
    let set = set_id(&pebble.directory(), &["flood.test"]);
    let lock = format!("floodgate:acme:lock:{set}");
    assert_eq!(redis.cli(&["SET", &lock, "someone", "PX", "60000"]).trim(), "OK");
    let token = "R".repeat(43);
    redis.cli(&[
        "HSET",
        &format!("floodgate:acme:challenges:{set}"),
        &format!("http-01:{token}"),
        "R.thumbprint",
    ]);
    let gateway = TestGateway::start(site.toml()).await;
    let addr = gateway.addr;
    let ask = move |token: String| {
        send(
            http::Request::get(format!("http://{addr}/.well-known/acme-challenge/{token}"))
                .header("host", "flood.test")
                .body(http_body_util::Full::new(bytes::Bytes::new()))
                .unwrap(),
        )
    };
    redis.pause();
    let flood: Vec<_> = (0..30).map(|i| tokio::spawn(ask(format!("{i:0>43}")))).collect();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let cas = tokio::spawn(ask(token));
    tokio::time::sleep(Duration::from_millis(200)).await;
    redis.resume();
    let (status, _, body) = cas.await.unwrap();
    assert_eq!((status.as_u16(), body.as_str()), (200, "R.thumbprint"));
    for request in flood {
        assert_eq!(request.await.unwrap().0, 404);
    }
    // One read answered them all (two when the paused one is already old when it returns).
    let reads = redis.command_calls("hgetall");
    assert!((1..=2).contains(&reads), "{reads}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ca_down_at_start_leaves_the_file_certificates_serving() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("files CA");
    let issued = ca.issue(&["files.test"]);
    std::fs::write(dir.path().join("files.crt"), &issued.cert).unwrap();
    std::fs::write(dir.path().join("files.key"), &issued.key).unwrap();
    std::fs::write(dir.path().join("ca.pem"), ca.pem()).unwrap();
    let stored = dir.path().join("acme-storage");
    let ca_file = dir.path().join("ca.pem");
    let text = Site {
        directory: format!("https://127.0.0.1:{}/dir", closed_port()),
        ca_file,
        domains: &["acme.test"],
        tls_keys: "certificates = [{ cert = \"files.crt\", key = \"files.key\" }]",
        acme_keys: storage(&stored),
        ..Site::default()
    }
    .toml();
    let path = dir.path().join("gateway.toml");
    std::fs::write(&path, text).unwrap();
    let gateway = TestGateway::start_config(Config::load(&path).unwrap()).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    while orders(&gateway, "error").await < 1.0 {
        assert!(Instant::now() < deadline, "the failed attempt was not counted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The file certificate serves its name, and stands in for the ACME one.
    let client = ca.client(&[b"http/1.1"]);
    assert_eq!(
        presented(&client, gateway.tls.unwrap(), "files.test").await,
        Some(issued.der.clone())
    );
    let probe = unverified_client(&[b"http/1.1"]);
    assert_eq!(
        presented(&probe, gateway.tls.unwrap(), "acme.test").await,
        Some(issued.der)
    );
    let (status, _, _) = get(&gateway.admin_url("/readyz")).await;
    assert_eq!(status, 200);
    // The next attempt waits a minute (kept on disk, so a restart waits too).
    let retry = std::fs::read_dir(&stored)
        .unwrap()
        .map(|entry| entry.unwrap().path().join("retry"))
        .find(|path| path.exists())
        .expect("the retry time is stored");
    let (at, failures) = std::fs::read_to_string(retry)
        .unwrap()
        .trim()
        .split_once(' ')
        .map(|(a, f)| (a.parse::<i64>().unwrap(), f.to_owned()))
        .unwrap();
    assert_eq!(failures, "1");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    assert!((55..=61).contains(&(at - now)), "{}", at - now);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(orders(&gateway, "error").await, 1.0);
}

/// The storage name of `domains`' certificate from `directory` (as floodgate derives it).
fn set_id(directory: &str, domains: &[&str]) -> String {
    use sha2::Digest as _;
    let mut sorted = domains.to_vec();
    sorted.sort();
    let digest = sha2::Sha256::digest(format!("{directory}\n{}", sorted.join("\n")).as_bytes());
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// A contact edited in the configuration reaches the CA's account (its expiry mail goes
/// there) at the reload, without an order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edited_contact_is_given_to_the_cas_account() {
    let (http, tls) = (free_port(), free_port());
    let pebble = Pebble::start(http, closed_port(), None);
    let path = pebble.dir().join("gateway.toml");
    let site = Site {
        listen: http,
        tls,
        ..Site::on(&pebble, &["contact.test"])
    }
    .toml();
    std::fs::write(&path, &site).unwrap();
    let gateway = TestGateway::start_config(Config::load(&path).unwrap()).await;
    Trusting::new(&pebble)
        .await
        .certificate(gateway.tls.unwrap(), "contact.test", Duration::from_secs(30))
        .await;
    // What the account last gave the CA, recorded once the CA took it.
    let given = || -> Option<String> {
        let entries = std::fs::read_dir(pebble.dir().join("acme-storage")).ok()?;
        entries
            .filter_map(Result::ok)
            .find(|entry| entry.file_name().to_string_lossy().ends_with(".contact"))
            .and_then(|entry| std::fs::read_to_string(entry.path()).ok())
    };
    assert_eq!(given().as_deref(), Some(CONTACT));
    std::fs::write(&path, site.replace(CONTACT, "mailto:new-ops@example.com")).unwrap();
    reload(&gateway, &path).await;
    let started = Instant::now();
    while given().as_deref() != Some("mailto:new-ops@example.com") {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the CA was not told: {:?}",
            given()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(orders(&gateway, "ok").await, 1.0);
}
