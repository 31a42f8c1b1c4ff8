//! One test per kind of configuration error, plus the defaults.

use super::*;
use crate::limit::redis::RedisTarget;
use crate::limit::store::OnError;

fn parse(text: &str) -> Result<Config, ConfigErrors> {
    Config::parse(Path::new("gw.toml"), text)
}

/// The single error of `text`, as `(line, column, key, message)`.
fn error(text: &str) -> (usize, usize, String, String) {
    let errors = parse(text).expect_err("the file is invalid").errors;
    assert_eq!(errors.len(), 1, "{errors:?}");
    let e = &errors[0];
    let (line, column) = e.position.expect("errors have a position");
    (line, column, e.key.clone(), e.message.clone())
}

const UPSTREAM: &str = "[upstreams.app]\nurl = \"http://127.0.0.1:9000\"\n";

#[test]
fn defaults() {
    let config = parse("").unwrap();
    assert_eq!(config.server.listen.to_string(), "0.0.0.0:8080");
    assert_eq!(config.server.admin_listen.to_string(), "127.0.0.1:9901");
    assert_eq!(config.server.shutdown_grace, Duration::from_secs(10));
    assert_eq!(config.server.header_timeout, Duration::from_secs(10));
    assert_eq!(config.server.body_timeout, Duration::from_secs(30));
    assert_eq!(config.server.send_timeout, Duration::from_secs(60));
    assert_eq!(config.server.tunnel_idle_timeout, Duration::from_secs(3600));
    assert_eq!(config.server.workers, 0);
    assert_eq!(config.server.ratelimit_headers, RateLimitHeaders::Ietf);
    assert_eq!(config.server.max_body, None);
    assert!(config.server.trusted_proxies.is_empty());
    assert!(config.routes.is_empty());
}

#[test]
fn a_full_file_is_validated_into_typed_values() {
    let config = parse(
        r#"
[server]
listen = "127.0.0.1:8081"
trusted_proxies = ["10.0.0.0/8", "192.168.1.1"]
shutdown_grace = "3s"
body_timeout = "5s"
send_timeout = "20s"
tunnel_idle_timeout = "10m"
workers = 2
ratelimit_headers = "both"
max_body = "10MB"

[upstreams.app]
url = "http://app.internal/base/"
connect_timeout = "250ms"
timeout = "5s"

[[routes]]
name = "api"
host = "*.Example.com"
path_prefix = "/api/"
methods = ["get", "POST"]
upstream = "app"

[[routes]]
name = "ping"
path = "/ping"
respond = { status = 204 }
"#,
    )
    .unwrap();
    assert_eq!(config.server.max_body, Some(10 << 20));
    assert_eq!(config.server.body_timeout, Duration::from_secs(5));
    assert_eq!(config.server.send_timeout, Duration::from_secs(20));
    assert_eq!(config.server.tunnel_idle_timeout, Duration::from_secs(600));
    assert_eq!(config.server.trusted_proxies.len(), 2);
    let app = &config.upstreams["app"];
    assert_eq!(app.servers[0].address.label(), "app.internal:80");
    assert_eq!(app.base_path, "/base");
    assert_eq!(app.connect_timeout, Duration::from_millis(250));
    let api = &config.routes[0];
    assert_eq!(api.host, Some(HostMatch::Wildcard(".example.com".into())));
    assert_eq!(api.path, PathMatch::Prefix("/api/".into()));
    assert_eq!(api.methods, Some(vec![Method::GET, Method::POST]));
    assert!(matches!(&api.target, RouteTarget::Upstream(u) if u.name == "app"));
    assert!(
        matches!(&config.routes[1].target, RouteTarget::Respond(r) if r.status == StatusCode::NO_CONTENT)
    );
}

#[test]
fn toml_syntax_error() {
    let (line, column, key, message) = error("[server]\nlisten = \"0.0.0.0:80\n");
    assert_eq!((line, key.as_str()), (2, ""));
    assert!(column >= 1);
    assert!(message.starts_with("invalid TOML"), "{message}");
}

#[test]
fn unknown_key() {
    let (line, column, key, message) = error("[server]\nlisten_addr = \"0.0.0.0:80\"\n");
    assert_eq!((line, column, key.as_str()), (2, 1, "server.listen_addr"));
    assert!(message.contains("unknown field `listen_addr`"), "{message}");
    assert!(message.contains("expected one of"), "{message}");
}

#[test]
fn unknown_table() {
    let (line, _, _, message) = error("[cache]\nsize = 1\n");
    assert_eq!(line, 1);
    assert!(message.contains("unknown field `cache`"), "{message}");
}

#[test]
fn wrong_type() {
    let (line, column, key, message) = error("[server]\nworkers = \"two\"\n");
    assert_eq!((line, column, key.as_str()), (2, 11, "server.workers"));
    assert!(message.contains("expected i64"), "{message}");
}

#[test]
fn max_connections_is_a_positive_count() {
    assert_eq!(parse("[server]\n").unwrap().server.max_connections, None);
    assert_eq!(
        parse("[server]\nmax_connections = 20000\n")
            .unwrap()
            .server
            .max_connections,
        Some(20_000)
    );
    for bad in ["0", "-5", "100000001"] {
        let (line, column, key, message) = error(&format!("[server]\nmax_connections = {bad}\n"));
        assert_eq!(
            (line, column, key.as_str()),
            (2, 19, "server.max_connections"),
            "{bad}"
        );
        assert!(message.contains("expected a connection count"), "{message}");
    }
}

#[test]
fn missing_required_key() {
    let (line, _, key, message) = error("[server]\n\n[[routes]]\npath = \"/\"\nrespond = {}\n");
    assert_eq!((line, key.as_str()), (3, "routes[0]"));
    assert!(message.contains("missing field `name`"), "{message}");
}

#[test]
fn bad_duration() {
    let (line, column, key, message) = error("[server]\nshutdown_grace = \"10 parsecs\"\n");
    assert_eq!((line, column, key.as_str()), (2, 18, "server.shutdown_grace"));
    assert!(message.starts_with("expected a duration"), "{message}");
}

#[test]
fn zero_timeout() {
    let (_, _, key, message) = error(&format!("{UPSTREAM}timeout = \"0s\"\n"));
    assert_eq!(key, "upstreams.app.timeout");
    assert!(message.contains("greater than zero"), "{message}");
}

#[test]
fn bad_size() {
    let (_, _, key, message) = error("[server]\nmax_body = \"lots\"\n");
    assert_eq!(key, "server.max_body");
    assert!(message.starts_with("expected a size"), "{message}");
}

#[test]
fn bad_cidr() {
    let (line, column, key, message) =
        error("[server]\ntrusted_proxies = [\"10.0.0.0/8\", \"10.0.0.0/99\"]\n");
    assert_eq!((line, column, key.as_str()), (2, 34, "server.trusted_proxies[1]"));
    assert!(message.starts_with("expected a CIDR"), "{message}");
}

#[test]
fn bad_socket_address() {
    let (_, _, key, message) = error("[server]\nlisten = \"localhost:80\"\n");
    assert_eq!(key, "server.listen");
    assert!(message.starts_with("expected an address"), "{message}");
}

#[test]
fn bad_workers_and_header_mode() {
    let errors = parse("[server]\nworkers = -1\nratelimit_headers = \"draft\"\n")
        .unwrap_err()
        .errors;
    let keys: Vec<_> = errors.iter().map(|e| e.key.as_str()).collect();
    assert_eq!(keys, ["server.workers", "server.ratelimit_headers"]);
}

#[test]
fn bad_upstream_url() {
    for url in [
        "127.0.0.1:9000",
        "ftp://host",
        "http://host/?q=1",
        "https://user@host",
    ] {
        let (_, _, key, _) = error(&format!("[upstreams.app]\nurl = \"{url}\"\n"));
        assert_eq!(key, "upstreams.app.url", "{url}");
    }
}

#[test]
fn unknown_upstream_reference() {
    let (line, column, key, message) = error(&format!(
        "{UPSTREAM}[[routes]]\nname = \"r\"\nupstream = \"ap\"\n"
    ));
    assert_eq!((line, column, key.as_str()), (5, 12, "routes[0].upstream"));
    assert!(message.contains("unknown upstream \"ap\""), "{message}");
    assert!(message.contains("\"app\""), "{message}");
}

#[test]
fn duplicate_route_name() {
    let (line, _, key, message) = error(&format!(
        "{UPSTREAM}[[routes]]\nname = \"r\"\nupstream = \"app\"\n[[routes]]\nname = \"r\"\nupstream = \"app\"\n"
    ));
    assert_eq!((line, key.as_str()), (7, "routes[1].name"));
    assert!(message.contains("already used"), "{message}");
}

#[test]
fn route_needs_exactly_one_target() {
    let (_, _, key, message) = error("[[routes]]\nname = \"r\"\n");
    assert_eq!(key, "routes[0]");
    assert!(message.contains("upstream"), "{message}");
    let (_, _, key, _) = error(&format!(
        "{UPSTREAM}[[routes]]\nname = \"r\"\nupstream = \"app\"\nrespond = {{ status = 200 }}\n"
    ));
    assert_eq!(key, "routes[0].respond");
}

#[test]
fn path_and_prefix_are_exclusive_and_normalized() {
    let (_, _, key, _) =
        error("[[routes]]\nname = \"r\"\npath = \"/a\"\npath_prefix = \"/b\"\nrespond = {}\n");
    assert_eq!(key, "routes[0].path_prefix");
    let (_, _, key, message) = error("[[routes]]\nname = \"r\"\npath_prefix = \"/a/../b\"\nrespond = {}\n");
    assert_eq!(key, "routes[0].path_prefix");
    assert!(message.contains("normalized path"), "{message}");
    let (_, _, key, _) = error("[[routes]]\nname = \"r\"\npath = \"api\"\nrespond = {}\n");
    assert_eq!(key, "routes[0].path");
    // Routes read encoded slashes as slashes: a route spelling one would never match.
    for path in ["/files/a%2Fb", "/files/a%2fb"] {
        let (_, _, key, message) = error(&format!(
            "[[routes]]\nname = \"r\"\npath = \"{path}\"\nrespond = {{}}\n"
        ));
        assert_eq!(key, "routes[0].path");
        assert!(message.contains("%2F"), "{message}");
    }
}

#[test]
fn bad_method_and_host() {
    let (_, _, key, _) = error("[[routes]]\nname = \"r\"\nmethods = [\"GET\", \"G T\"]\nrespond = {}\n");
    assert_eq!(key, "routes[0].methods[1]");
    let (_, _, key, message) = error("[[routes]]\nname = \"r\"\nhost = \"example.com:80\"\nrespond = {}\n");
    assert_eq!(key, "routes[0].host");
    assert!(message.contains("no port"), "{message}");
}

#[test]
fn bad_respond_status() {
    let (_, _, key, message) = error("[[routes]]\nname = \"r\"\nrespond = { status = 99 }\n");
    assert_eq!(key, "routes[0].respond.status");
    assert!(message.contains("200 to 599"), "{message}");
}

#[test]
fn every_problem_is_reported_at_once() {
    let errors = parse(&format!(
        "[server]\nlisten = \"nope\"\nshutdown_grace = \"x\"\n{UPSTREAM}[[routes]]\nname = \"r\"\nupstream = \"zzz\"\n"
    ))
    .unwrap_err();
    assert_eq!(errors.errors.len(), 3);
    let text = errors.to_string();
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[0].starts_with("gw.toml:2:10: server.listen: expected an address"),
        "{text}"
    );
    assert!(
        lines[1].starts_with("gw.toml:3:18: server.shutdown_grace: expected a duration"),
        "{text}"
    );
    assert!(
        lines[2].starts_with("gw.toml:8:12: routes[0].upstream: unknown upstream"),
        "{text}"
    );
}

const LIMITED_ROUTE: &str = "[[routes]]\nname = \"r\"\nrespond = {}\nlimits = [\"l\"]\n";

#[test]
fn limits_are_validated_per_algorithm() {
    let config = parse(&format!(
        r#"
[redis]
url = "redis://127.0.0.1:6379/0"
prefix = "fg"
timeout = "20ms"
on_error = "deny"

[limits.l]
algorithm = "token_bucket"
rate = 10
per = "1s"
key = ["header:X-Api-Key", "client_ip", "query:k", "cookie:s", "method", "path", "host", "route"]
lockout = "5m"
exempt = ["10.0.0.0/8"]
mode = "shadow"
status = 503
message = "slow down\n"

[limits.w]
algorithm = "sliding_window"
limit = 600
window = "1m"

{LIMITED_ROUTE}cost = 3
"#
    ))
    .unwrap();
    let redis = config.redis.as_ref().unwrap();
    assert_eq!(
        (redis.prefix.as_str(), redis.timeout, redis.on_error),
        ("fg", Duration::from_millis(20), OnError::Deny)
    );
    let l = &config.limits["l"];
    let rate = l.rate().unwrap();
    assert_eq!(
        rate.algorithm,
        crate::limit::Algorithm::TokenBucket {
            rate: 10.0,
            per: 1_000_000,
            burst: 10
        }
    );
    assert_eq!(l.key.len(), 8);
    assert_eq!(
        l.key[0],
        KeyPart::Header(http::HeaderName::from_static("x-api-key"))
    );
    assert_eq!(
        (l.mode, l.status.as_u16(), rate.lockout),
        (Mode::Shadow, 503, Some(Duration::from_secs(300)))
    );
    let policy = |limit: &LimitConfig| {
        let rate = limit.rate().unwrap();
        crate::service::limit_headers::Described {
            name: &limit.name,
            algorithm: &rate.algorithm,
        }
        .policy()
    };
    assert_eq!(policy(l), (10, 1));
    assert_eq!(policy(&config.limits["w"]), (600, 60));
    assert_eq!(config.routes[0].cost, 3);
    assert_eq!(&*config.routes[0].limits[0].name, "l");
}

#[test]
fn a_key_of_another_algorithm_is_an_error() {
    let (line, _, key, message) =
        error("[limits.l]\nalgorithm = \"fixed_window\"\nlimit = 5\nwindow = \"1m\"\nburst = 3\n");
    assert_eq!((line, key.as_str()), (5, "limits.l.burst"));
    assert!(message.contains("does not apply"), "{message}");
    let (_, _, key, _) = error("[limits.l]\nalgorithm = \"token_bucket\"\nrate = 5\nwindow = \"1m\"\n");
    assert_eq!(key, "limits.l.window");
}

#[test]
fn limit_values_are_range_checked() {
    for (body, bad_key) in [
        (
            "algorithm = \"fixed_window\"\nlimit = 0\nwindow = \"1m\"",
            "limits.l.limit",
        ),
        (
            "algorithm = \"fixed_window\"\nlimit = 1\nwindow = \"0s\"",
            "limits.l.window",
        ),
        ("algorithm = \"fixed_window\"\nlimit = 1", "limits.l.window"),
        ("algorithm = \"token_bucket\"\nrate = 0", "limits.l.rate"),
        (
            "algorithm = \"token_bucket\"\nrate = 1e-300\nburst = 1",
            "limits.l.rate",
        ),
        (
            "algorithm = \"leaky_bucket\"\nrate = 1\nper = \"40000d\"\nburst = 1",
            "limits.l.rate",
        ),
        (
            "algorithm = \"leaky_bucket\"\nrate = 1\nburst = 0",
            "limits.l.burst",
        ),
        ("algorithm = \"gcra\"", "limits.l.algorithm"),
        (
            "algorithm = \"token_bucket\"\nrate = 1\nkey = [\"header:\"]",
            "limits.l.key[0]",
        ),
        (
            "algorithm = \"token_bucket\"\nrate = 1\nkey = [\"ip\"]",
            "limits.l.key[0]",
        ),
        (
            "algorithm = \"token_bucket\"\nrate = 1\nkey = [\"client_ip\", \"query:us;er\"]",
            "limits.l.key[1]",
        ),
        (
            "algorithm = \"token_bucket\"\nrate = 1\nkey = [\"cookie:a=b\"]",
            "limits.l.key[0]",
        ),
        (
            "algorithm = \"token_bucket\"\nrate = 1\nmode = \"dry\"",
            "limits.l.mode",
        ),
        (
            "algorithm = \"token_bucket\"\nrate = 1\nstatus = 200",
            "limits.l.status",
        ),
        (
            "algorithm = \"token_bucket\"\nrate = 1\nexempt = [\"x\"]",
            "limits.l.exempt[0]",
        ),
    ] {
        let (_, _, key, _) = error(&format!("[limits.l]\n{body}\n"));
        assert_eq!(key, bad_key, "{body}");
    }
}

#[test]
fn route_limits_resolve_and_cost_is_positive() {
    let (_, _, key, message) = error(LIMITED_ROUTE);
    assert_eq!(key, "routes[0].limits[0]");
    assert!(message.contains("unknown limit \"l\""), "{message}");
    let (_, _, key, _) = error("[[routes]]\nname = \"r\"\nrespond = {}\ncost = 0\n");
    assert_eq!(key, "routes[0].cost");
}

#[test]
fn a_route_names_at_most_the_limits_one_store_call_can_carry() {
    let mut text = String::new();
    let names: Vec<String> = (0..=MAX_LIMITS_PER_ROUTE).map(|i| format!("\"l{i}\"")).collect();
    for i in 0..=MAX_LIMITS_PER_ROUTE {
        text.push_str(&format!(
            "[limits.l{i}]\nalgorithm = \"fixed_window\"\nlimit = 1\nwindow = \"1s\"\n"
        ));
    }
    let route = |names: &[String]| {
        format!(
            "[[routes]]\nname = \"r\"\nrespond = {{}}\nlimits = [{}]\n",
            names.join(", ")
        )
    };
    assert!(parse(&format!("{text}{}", route(&names[..MAX_LIMITS_PER_ROUTE]))).is_ok());
    let (line, column, key, message) = error(&format!("{text}{}", route(&names)));
    assert_eq!(key, format!("routes[0].limits[{MAX_LIMITS_PER_ROUTE}]"));
    assert_eq!(
        message,
        format!("a route names at most {MAX_LIMITS_PER_ROUTE} limits")
    );
    let last_line = 4 * (MAX_LIMITS_PER_ROUTE + 1) + 4;
    let last_name = route(&names)
        .lines()
        .nth(3)
        .unwrap()
        .rfind(&names[MAX_LIMITS_PER_ROUTE])
        .unwrap()
        + 1;
    assert_eq!((line, column), (last_line, last_name));
}

#[test]
fn redis_settings() {
    let (_, _, key, _) = error("[redis]\nurl = \"http://x\"\n");
    assert_eq!(key, "redis.url");
    let (_, _, key, _) = error("[redis]\nurl = \"redis://x\"\nprefix = \"a{b}\"\n");
    assert_eq!(key, "redis.prefix");
    let cluster = parse("[redis]\nurl = \"redis://10.0.0.7:7000\"\ncluster = true\n").unwrap();
    assert_eq!(
        cluster.redis.unwrap().target,
        RedisTarget::Cluster("redis://10.0.0.7:7000".into())
    );
    let (_, _, key, _) = error("[redis]\ncluster = true\nsentinels = [\"redis://y\"]\nmaster_name = \"m\"\n");
    assert_eq!(key, "redis.sentinels");
    let (_, _, _, message) = error("[redis]\nurl = \"redis://user:s3cret@x:6379/0\"\non_error = \"maybe\"\n");
    assert!(!message.contains("s3cret"));
    let errors = parse("[redis]\nurl = \"redis://:s3cret@x:99999\"\n")
        .unwrap_err()
        .to_string();
    assert!(!errors.contains("s3cret"), "{errors}");
}

#[test]
fn redis_url_from_the_environment() {
    let in_environment = |url: &str| Environment {
        redis_url: Some(url.to_owned()),
        ..Environment::default()
    };
    let config = Config::parse_in(
        Path::new("gw.toml"),
        "",
        &in_environment("redis://10.1.1.1:6380/2"),
    )
    .unwrap();
    let redis = config.redis.unwrap();
    assert_eq!(
        (&redis.target, redis.prefix.as_str()),
        (&RedisTarget::Url("redis://10.1.1.1:6380/2".into()), "floodgate")
    );
    let errors = Config::parse_in(Path::new("gw.toml"), "", &in_environment("nope"))
        .unwrap_err()
        .errors;
    assert_eq!(errors[0].key, "FLOODGATE_REDIS_URL");
}

#[test]
fn sentinels_name_a_master() {
    let config = parse(
        "[redis]\nsentinels = [\"redis://10.0.0.5:26379\", \"redis://10.0.0.6:26379\"]\nmaster_name = \"mymaster\"\n",
    )
    .unwrap();
    assert_eq!(
        config.redis.unwrap().target,
        RedisTarget::Sentinel {
            sentinels: vec!["redis://10.0.0.5:26379".into(), "redis://10.0.0.6:26379".into()],
            master_name: "mymaster".into(),
        }
    );
    let (_, _, key, _) = error("[redis]\nsentinels = [\"redis://10.0.0.5:26379\"]\n");
    assert_eq!(key, "redis.master_name");
    let (_, _, key, _) =
        error("[redis]\nurl = \"redis://x\"\nsentinels = [\"redis://y\"]\nmaster_name = \"m\"\n");
    assert_eq!(key, "redis.url");
    let (_, _, key, _) = error("[redis]\nsentinels = [\"http://y\"]\nmaster_name = \"m\"\n");
    assert_eq!(key, "redis.sentinels");
}

#[test]
fn an_upstream_url_is_one_server_with_the_defaults() {
    let config = parse(UPSTREAM).unwrap();
    let app = &config.upstreams["app"];
    assert_eq!(app.servers.len(), 1);
    assert_eq!(app.servers[0].weight, 1);
    assert_eq!(app.balance, Balance::RoundRobin);
    assert_eq!((app.max_fails, app.fail_timeout), (1, Duration::from_secs(10)));
    assert_eq!(app.retries, 1);
    assert_eq!(app.health_check, None);
    assert_eq!((app.max_requests, app.queue), (0, 100));
    assert_eq!(app.queue_timeout, Duration::from_secs(5));
}

#[test]
fn every_upstream_key() {
    let config = parse(
        r#"
[upstreams.php]
servers = ["http://10.0.0.5:9000/app", { url = "http://10.0.0.6:9000/app/", weight = 2 }]
balance = "hash"
hash_key = ["cookie:PHPSESSID"]
max_fails = 3
fail_timeout = "30s"
retries = 2
health_check = { path = "/health?full=1", interval = "2s", timeout = "500ms" }
max_requests = 20
queue = 50
queue_timeout = "2s"
"#,
    )
    .unwrap();
    let php = &config.upstreams["php"];
    let servers: Vec<_> = php
        .servers
        .iter()
        .map(|s| (s.address.label(), s.weight))
        .collect();
    assert_eq!(
        servers,
        [("10.0.0.5:9000".to_owned(), 1), ("10.0.0.6:9000".to_owned(), 2)]
    );
    assert_eq!(php.base_path, "/app");
    assert_eq!(
        php.balance,
        Balance::Hash(vec![KeyPart::Cookie("PHPSESSID".into())])
    );
    assert_eq!((php.max_fails, php.fail_timeout), (3, Duration::from_secs(30)));
    assert_eq!(php.retries, 2);
    let check = php.health_check.as_ref().unwrap();
    assert_eq!(check.path.as_str(), "/health?full=1");
    assert_eq!(
        (check.interval, check.timeout),
        (Duration::from_secs(2), Duration::from_millis(500))
    );
    assert_eq!((php.max_requests, php.queue), (20, 50));
    assert_eq!(php.queue_timeout, Duration::from_secs(2));
    let hashed = parse("[upstreams.a]\nurl = \"http://a:1\"\nbalance = \"hash\"\n").unwrap();
    assert_eq!(
        hashed.upstreams["a"].balance,
        Balance::Hash(vec![KeyPart::ClientIp])
    );
}

#[test]
fn bad_upstream_keys_name_their_place() {
    let table = |body: &str| format!("[upstreams.app]\n{body}\n");
    let cases: &[(&str, (usize, usize, &str), &str)] = &[
        (
            "servers = []",
            (2, 11, "upstreams.app.servers"),
            "at least one server",
        ),
        (
            "url = \"http://a:1\"\nservers = [\"http://b:1\"]",
            (2, 7, "upstreams.app.url"),
            "either `url` or `servers`",
        ),
        (
            "servers = [{ url = \"http://a:1\", weight = 0 }]",
            (2, 12, "upstreams.app.servers[0].weight"),
            "weight from 1 to 1000",
        ),
        (
            "servers = [\"http://a:1\", \"http://a:1/\"]",
            (2, 26, "upstreams.app.servers[1]"),
            "listed twice",
        ),
        (
            "servers = [\"http://a:1/x\", \"http://b:1/y\"]",
            (2, 28, "upstreams.app.servers[1].url"),
            "the same scheme and path",
        ),
        (
            "url = \"http://a:1\"\nbalance = \"random\"",
            (3, 11, "upstreams.app.balance"),
            "least_requests",
        ),
        (
            "url = \"http://a:1\"\nhash_key = [\"client_ip\"]",
            (3, 12, "upstreams.app.hash_key"),
            "only with balance = \"hash\"",
        ),
        (
            "url = \"http://a:1\"\nbalance = \"hash\"\nhash_key = [\"cookie:\"]",
            (4, 13, "upstreams.app.hash_key[0]"),
            "cookie:NAME",
        ),
        (
            "url = \"http://a:1\"\nmax_fails = -1",
            (3, 13, "upstreams.app.max_fails"),
            "from 0 to",
        ),
        (
            "url = \"http://a:1\"\nqueue_timeout = \"0s\"",
            (3, 17, "upstreams.app.queue_timeout"),
            "duration",
        ),
        (
            "url = \"http://a:1\"\nhealth_check = { path = \"health\" }",
            (3, 25, "upstreams.app.health_check.path"),
            "\"/health\"",
        ),
    ];
    for (body, (line, column, key), needle) in cases {
        let (l, c, k, message) = error(&table(body));
        assert_eq!((l, c, k.as_str()), (*line, *column, *key), "{body}: {message}");
        assert!(message.contains(needle), "{body}: {message}");
    }
    let long = format!(
        "url = \"http://a:1\"\nhealth_check = {{ path = \"/{}\" }}",
        "a".repeat(8192)
    );
    let (l, c, k, message) = error(&table(&long));
    assert_eq!((l, c, k.as_str()), (3, 25, "upstreams.app.health_check.path"));
    assert!(message.contains("at most 8192 bytes"), "{message}");
    let (line, _, key, message) = error("[upstreams.app]\nconnect_timeout = \"1s\"\n");
    assert_eq!((line, key.as_str()), (1, "upstreams.app"));
    assert!(
        message.contains("url = \"http://host:port\" or servers"),
        "{message}"
    );
}

#[test]
fn tls_ca_applies_only_to_https_upstreams_and_must_load() {
    let (line, column, key, message) = error("[upstreams.app]\nurl = \"http://a:1\"\ntls_ca = \"ca.pem\"\n");
    assert_eq!((line, column, key.as_str()), (3, 10, "upstreams.app.tls_ca"));
    assert!(message.contains("only to https://"), "{message}");
    let (_, _, key, message) = error("[upstreams.app]\nurl = \"https://a:1\"\ntls_ca = \"missing.pem\"\n");
    assert_eq!(key, "upstreams.app.tls_ca");
    assert!(message.contains("missing.pem"), "{message}");
}

#[test]
fn an_https_upstream_defaults_to_port_443_and_the_system_roots() {
    let config =
        parse("[upstreams.app]\nurl = \"https://app.internal\"\ntls_server_name = \"app\"\n").unwrap();
    let app = &config.upstreams["app"];
    assert_eq!(app.servers[0].address.label(), "app.internal:443");
    let tls = app.tls.as_ref().unwrap();
    assert_eq!(tls.roots, None);
    assert_eq!(
        tls.server_name.as_ref().map(|n| n.to_str().into_owned()),
        Some("app".to_owned())
    );
}

#[test]
fn access_lists_are_cidrs() {
    let config = parse(&format!(
        "[server]\ndeny = [\"10.0.0.0/8\"]\n\n{UPSTREAM}[[routes]]\nname = \"r\"\npath_prefix = \"/\"\nupstream = \"app\"\nallow = [\"192.0.2.1\"]\n"
    ))
    .unwrap();
    assert_eq!(config.server.deny.len(), 1);
    let route = &config.routes[0];
    assert!(route.admits("192.0.2.1".parse().unwrap()));
    assert!(!route.admits("192.0.2.2".parse().unwrap()));
    let (line, column, key, _) = error(&format!(
        "{UPSTREAM}[[routes]]\nname = \"r\"\npath_prefix = \"/\"\nupstream = \"app\"\ndeny = [\"10.0.0.0/33\"]\n"
    ));
    assert_eq!((line, column, key.as_str()), (7, 9, "routes[0].deny[0]"));
}

#[test]
fn overrides_are_validated_as_the_limit_itself() {
    let limit = |overrides: &str| {
        format!(
            "[limits.api]\nalgorithm = \"token_bucket\"\nrate = 1\nburst = 2\nkey = [\"header:x-key\", \"client_ip\"]\noverrides = [{overrides}]\n"
        )
    };
    assert!(
        parse(&limit(
            "{ key = [\"gold\", \"10.0.0.0/8\"], burst = 5 }, { key = [\"x\", \"10.0.0.1\"], exempt = true }"
        ))
        .is_ok()
    );
    let cases = [
        (
            "{ key = [\"gold\"], burst = 5 }",
            "limits.api.overrides[0].key",
            "2 value(s)",
        ),
        (
            "{ key = [\"gold\", \"10.0.0.1\"], burst = 0 }",
            "limits.api.overrides[0].burst",
            "≥ 1",
        ),
        (
            "{ key = [\"gold\", \"10.0.0.1\"], limit = 5 }",
            "limits.api.overrides[0].limit",
            "does not apply",
        ),
        (
            "{ key = [\"gold\", \"not-an-ip\"], burst = 5 }",
            "limits.api.overrides[0].key[1]",
            "",
        ),
        (
            "{ key = [\"gold\", \"10.0.0.1\"], exempt = true, burst = 5 }",
            "limits.api.overrides[0]",
            "no parameters",
        ),
    ];
    for (entry, key, needle) in cases {
        let errors = parse(&limit(entry)).unwrap_err().errors;
        assert!(
            errors.iter().any(|e| e.key == key && e.message.contains(needle)),
            "{entry}: {errors:?}"
        );
    }
}

#[test]
fn an_override_for_a_path_or_host_no_request_reads_as_is_refused() {
    let limit = |overrides: &str| {
        format!(
            "[limits.pages]\nalgorithm = \"fixed_window\"\nlimit = 5\nwindow = \"1m\"\nkey = [\"path\", \"host\"]\noverrides = [{overrides}]\n"
        )
    };
    assert!(parse(&limit("{ key = [\"/a/b\", \"shop.example.com\"], limit = 9 }")).is_ok());
    let cases = [
        ("\"/a%2Fb\", \"shop.example.com\"", "key[0]", "reads as \"/a/b\""),
        (
            "\"/a//b/../c\", \"shop.example.com\"",
            "key[0]",
            "reads as \"/a/c\"",
        ),
        ("\"/%61\", \"shop.example.com\"", "key[0]", "reads as \"/a\""),
        ("\"a/b\", \"shop.example.com\"", "key[0]", "never matches"),
        (
            "\"/a\", \"Shop.Example.com:8080\"",
            "key[1]",
            "reads as \"shop.example.com\"",
        ),
        ("\"/a\", \"\"", "key[1]", "never matches"),
    ];
    for (key, at, needle) in cases {
        let entry = format!("{{ key = [{key}], limit = 9 }}");
        let errors = parse(&limit(&entry)).unwrap_err().errors;
        assert!(
            errors
                .iter()
                .any(|e| e.key == format!("limits.pages.overrides[0].{at}") && e.message.contains(needle)),
            "{entry}: {errors:?}"
        );
    }
}

#[test]
fn counting_failures() {
    let limit = |extra: &str| {
        format!("[limits.l]\nalgorithm = \"fixed_window\"\nlimit = 5\nwindow = \"15m\"\n{extra}\n")
    };
    let config = parse(&limit("count = \"failures\"")).unwrap();
    assert_eq!(
        config.limits["l"].rate().unwrap().failures,
        Some(vec![StatusCode::UNAUTHORIZED, StatusCode::FORBIDDEN])
    );
    let config = parse(&limit("count = \"failures\"\nfailure_status = [401, 429]")).unwrap();
    assert_eq!(
        config.limits["l"].rate().unwrap().failures,
        Some(vec![StatusCode::UNAUTHORIZED, StatusCode::TOO_MANY_REQUESTS])
    );
    assert_eq!(
        parse(&limit("")).unwrap().limits["l"].rate().unwrap().failures,
        None
    );
    let (_, _, key, _) = error(&limit("failure_status = [401]"));
    assert_eq!(key, "limits.l.failure_status");
    let (_, _, key, _) = error(&limit("count = \"errors\""));
    assert_eq!(key, "limits.l.count");
    let (_, _, key, message) = error(&limit("count = \"failures\"\nfailure_status = [99]"));
    assert_eq!(key, "limits.l.failure_status[0]");
    assert_eq!(message, "expected an HTTP status from 100 to 599, got 99");
    let (_, _, key, message) = error(&limit("status = 200"));
    assert_eq!(key, "limits.l.status");
    assert_eq!(message, "expected an HTTP status from 400 to 599, got 200");
    let (_, _, key, message) =
        error("[limits.l]\nalgorithm = \"leaky_bucket\"\nrate = 1\nburst = 1\ncount = \"failures\"\n");
    assert_eq!(key, "limits.l.count");
    assert!(message.contains("token_bucket"), "{message}");
}

#[test]
fn concurrency_limits() {
    let config =
        parse("[limits.c]\nalgorithm = \"concurrency\"\nlimit = 4\nkey = [\"client_ip\"]\nlease = \"10s\"\n")
            .unwrap();
    let concurrency = |limit: &LimitConfig| match limit.kind {
        LimitKind::Concurrency(concurrency) => concurrency,
        LimitKind::Rate(_) => panic!("{} is a rate limit", limit.name),
    };
    let c = concurrency(&config.limits["c"]);
    assert_eq!((c.limit, c.lease), (4, Duration::from_secs(10)));
    let default = parse("[limits.c]\nalgorithm = \"concurrency\"\nlimit = 1\n").unwrap();
    assert_eq!(concurrency(&default.limits["c"]).lease, Duration::from_secs(30));
    for (extra, key) in [
        ("lockout = \"1h\"", "limits.c.lockout"),
        ("window = \"1s\"", "limits.c.window"),
        ("lease = \"1s\"", "limits.c.lease"),
        ("count = \"failures\"", "limits.c.count"),
    ] {
        let errors = parse(&format!(
            "[limits.c]\nalgorithm = \"concurrency\"\nlimit = 1\n{extra}\n"
        ))
        .unwrap_err()
        .errors;
        assert!(errors.iter().any(|e| e.key == key), "{extra}: {errors:?}");
    }
    let (_, _, key, _) = error("[limits.c]\nalgorithm = \"concurrency\"\nlimit = 0\n");
    assert_eq!(key, "limits.c.limit");
    let (_, _, key, _) =
        error("[limits.r]\nalgorithm = \"fixed_window\"\nlimit = 1\nwindow = \"1s\"\nlease = \"5s\"\n");
    assert_eq!(key, "limits.r.lease");
}

#[test]
fn request_id_names_a_header_of_its_own() {
    let config = parse("").unwrap();
    assert_eq!(config.server.request_id.unwrap(), "x-request-id");
    let config = parse("[server]\nrequest_id = \"X-Correlation-Id\"\n").unwrap();
    assert_eq!(config.server.request_id.unwrap(), "x-correlation-id");
    assert_eq!(
        parse("[server]\nrequest_id = \"\"\n").unwrap().server.request_id,
        None
    );
    for (name, says) in [
        ("Content-Length", "for something else"),
        ("traceparent", "for something else"),
        ("X-Forwarded-For", "for something else"),
        ("X-Forwarded-Port", "for something else"),
        ("X-Real-IP", "for something else"),
        ("Via", "for something else"),
        ("Host", "for something else"),
        ("Keep-Alive", "for something else"),
        ("Forwarded", "for something else"),
        ("tracestate", "for something else"),
        ("X_Request_Id", "holds `_`"),
        ("bad name", "not a header name"),
    ] {
        let (line, column, key, message) = error(&format!("[server]\nrequest_id = \"{name}\"\n"));
        assert_eq!(
            (line, column, key.as_str()),
            (2, 14, "server.request_id"),
            "{name}"
        );
        assert!(message.contains(says), "{name}: {message}");
    }
}

#[test]
fn tracing_needs_a_collector_url_and_a_share() {
    let config = parse("[tracing]\nendpoint = \"http://otel:4318\"\n").unwrap();
    let tracing = config.tracing.unwrap();
    assert_eq!(
        (tracing.sample, tracing.service_name.as_str()),
        (1.0, "floodgate")
    );
    for (table, key, says) in [
        ("endpoint = \"otel:4318\"", "tracing.endpoint", "base URL"),
        (
            "endpoint = \"http://user:pw@otel:4318\"",
            "tracing.endpoint",
            "credentials",
        ),
        (
            "endpoint = \"http://otel:4318\"\nsample = 1.5",
            "tracing.sample",
            "from 0 to 1",
        ),
        (
            "endpoint = \"http://otel:4318\"\nservice_name = \" \"",
            "tracing.service_name",
            "a name",
        ),
    ] {
        let (_, _, got, message) = error(&format!("[tracing]\n{table}\n"));
        assert_eq!(got, key, "{table}");
        assert!(message.contains(says), "{table}: {message}");
    }
}

/// `[server.tls]` with only `[server.tls.acme]` holding `acme` (and `storage`).
fn acme_table(acme: &str) -> String {
    format!(
        "[server.tls]\nlisten = \"127.0.0.1:8443\"\n\n[server.tls.acme]\n{acme}\nstorage = \"/var/lib/floodgate/acme\"\n"
    )
}

#[test]
fn acme_alone_needs_no_certificate_files() {
    let config = parse(&acme_table(
        "directory = \"https://ca.example/dir\"\ncontact = [\"mailto:a@example.com\", \"mailto:b@example.com\"]\ndomains = [\"WWW.Example.com\", \"example.com.\"]",
    ))
    .unwrap();
    let tls = config.server.tls.unwrap();
    assert!(tls.certificates.is_empty());
    let acme = tls.acme.unwrap();
    assert_eq!(acme.domains, ["www.example.com", "example.com"]);
    assert_eq!(acme.contact, ["mailto:a@example.com", "mailto:b@example.com"]);
    assert_eq!(
        acme.storage.as_deref(),
        Some(Path::new("/var/lib/floodgate/acme"))
    );
    assert_eq!(acme.ca, None);
}

#[test]
fn acme_errors_name_their_key_and_position() {
    let valid = "directory = \"https://ca.example/dir\"\ndomains = [\"a.example\"]";
    let cases = [
        (
            "directory = \"http://ca.example/dir\"\ndomains = [\"a.example\"]",
            (5, 13, "server.tls.acme.directory", "https://"),
        ),
        (
            "directory = \"https://ca.example/dir\"\ndomains = [\"a.example\", \"*.example.com\"]",
            (6, 25, "server.tls.acme.domains[1]", "dns-01"),
        ),
        (
            "directory = \"https://ca.example/dir\"\ndomains = [\"a.example\", \"A.example\"]",
            (6, 25, "server.tls.acme.domains[1]", "listed twice"),
        ),
        (
            "directory = \"https://ca.example/dir\"\ndomains = []",
            (6, 11, "server.tls.acme.domains", "1 to 100"),
        ),
        (
            "directory = \"https://ca.example/dir\"\ndomains = [\"10.0.0.1\"]",
            (6, 12, "server.tls.acme.domains[0]", "not an address"),
        ),
        (
            &format!("{valid}\ncontact = \"ops@example.com\""),
            (7, 11, "server.tls.acme.contact", "mailto:"),
        ),
        (
            &format!("{valid}\nca = \"/no/such/ca.pem\""),
            (7, 6, "server.tls.acme.ca", "/no/such/ca.pem"),
        ),
    ];
    for (acme, (line, column, key, message)) in cases {
        let (l, c, k, m) = error(&acme_table(acme));
        assert_eq!((l, c, k.as_str()), (line, column, key), "{acme}: {m}");
        assert!(m.contains(message), "{acme}: {m}");
    }
}

#[test]
fn acme_needs_storage_or_redis_and_tls_needs_a_certificate_or_acme() {
    let acme = "[server.tls]\nlisten = \"127.0.0.1:8443\"\n\n[server.tls.acme]\ndirectory = \"https://ca.example/dir\"\ndomains = [\"a.example\"]\n";
    let (line, column, key, message) = error(acme);
    assert_eq!((line, column, key.as_str()), (4, 1, "server.tls.acme.storage"));
    assert!(message.contains("[redis]"), "{message}");
    // With [redis], the instances keep it there.
    let shared = parse(&format!("{acme}\n[redis]\nurl = \"redis://127.0.0.1:6379\"\n")).unwrap();
    assert!(shared.server.tls.unwrap().acme.unwrap().storage.is_none());
    // And with Redis from FLOODGATE_REDIS_URL.
    let environment = Environment {
        redis_url: Some("redis://127.0.0.1:6379".to_owned()),
        ..Environment::default()
    };
    let shared = Config::parse_in(Path::new("gw.toml"), acme, &environment).unwrap();
    assert!(shared.redis.is_some());
    let (line, _, key, _) = error("[server.tls]\nlisten = \"127.0.0.1:8443\"\ncertificates = []\n");
    assert_eq!((line, key.as_str()), (3, "server.tls.certificates"));
}

#[test]
fn an_external_account_binding_is_decoded_and_never_printed() {
    let config = parse(&acme_table(
        "directory = \"https://ca.example/dir\"\ndomains = [\"a.example\"]\neab = { kid = \"kid-1\", hmac_key = \"c2VjcmV0LWtleQ\" }",
    ))
    .unwrap();
    let eab = config.server.tls.unwrap().acme.unwrap().eab.unwrap();
    assert_eq!(
        (eab.kid.as_str(), eab.hmac_key.as_slice()),
        ("kid-1", &b"secret-key"[..])
    );
    assert!(!format!("{eab:?}").contains("c2Vj") && !format!("{eab:?}").contains("secret"));
    let (line, column, key, _) = error(&acme_table(
        "directory = \"https://ca.example/dir\"\ndomains = [\"a.example\"]\neab = { kid = \"kid-1\", hmac_key = \"not base64!\" }",
    ));
    assert_eq!(
        (line, column, key.as_str()),
        (7, 35, "server.tls.acme.eab.hmac_key")
    );
}

#[test]
fn acme_storage_and_ca_are_relative_to_the_configuration_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca = params.self_signed(&rcgen::KeyPair::generate().unwrap()).unwrap();
    std::fs::create_dir(dir.path().join("tls")).unwrap();
    std::fs::write(dir.path().join("tls/ca.pem"), ca.pem()).unwrap();
    let text =
        acme_table("directory = \"https://ca.example/dir\"\ndomains = [\"a.example\"]\nca = \"tls/ca.pem\"")
            .replace("/var/lib/floodgate/acme", "state/acme");
    let config = Config::parse(&dir.path().join("gateway.toml"), &text).unwrap();
    let acme = config.server.tls.unwrap().acme.unwrap();
    assert_eq!(acme.storage.unwrap(), dir.path().join("state/acme"));
    assert_eq!(acme.ca.unwrap(), [ca.der().clone()]);
    // Resolved against the file's directory, not the working directory.
    let elsewhere = Config::parse(&dir.path().join("other/gateway.toml"), &text);
    assert!(elsewhere.is_err(), "tls/ca.pem is not under other/");
}

#[test]
fn a_limit_fills_and_empties_within_35_years() {
    for (limit, key) in [
        (
            "algorithm = \"token_bucket\"\nrate = 1\nper = \"1d\"\nburst = 4294967295",
            "limits.l.burst",
        ),
        (
            "algorithm = \"leaky_bucket\"\nrate = 1\nper = \"1d\"\nburst = 14000",
            "limits.l.burst",
        ),
        (
            "algorithm = \"fixed_window\"\nlimit = 10\nwindow = \"400000years\"",
            "limits.l.window",
        ),
        (
            "algorithm = \"sliding_window\"\nlimit = 10\nwindow = \"36years\"",
            "limits.l.window",
        ),
    ] {
        let (_, _, found, message) = error(&format!("[limits.l]\n{limit}\n"));
        assert_eq!(found, key, "{limit}");
        assert!(message.contains("35 years"), "{message}");
    }
    // 12,000 days, and 35 years less a day: inside.
    parse("[limits.l]\nalgorithm = \"token_bucket\"\nrate = 1\nper = \"1d\"\nburst = 12000\n").unwrap();
    parse("[limits.l]\nalgorithm = \"fixed_window\"\nlimit = 1\nwindow = \"12000d\"\n").unwrap();
}

#[test]
fn a_route_whose_cost_its_limit_never_admits_is_refused() {
    let route = |limit: &str, cost: u64| {
        format!(
            "[limits.l]\n{limit}\n[[routes]]\nname = \"r\"\nrespond = {{}}\nlimits = [\"l\"]\ncost = {cost}\n"
        )
    };
    for (limit, most) in [
        ("algorithm = \"fixed_window\"\nlimit = 3\nwindow = \"1m\"", 3),
        ("algorithm = \"sliding_window\"\nlimit = 3\nwindow = \"1m\"", 3),
        ("algorithm = \"token_bucket\"\nrate = 1\nburst = 3", 3),
        // The request served now, and three that wait.
        ("algorithm = \"leaky_bucket\"\nrate = 1\nburst = 3", 4),
    ] {
        parse(&route(limit, most)).unwrap();
        let (_, _, key, message) = error(&route(limit, most + 1));
        assert_eq!(key, "routes[0].cost", "{limit}");
        assert!(
            message.contains(&format!("limit \"l\" admits at most {most}")),
            "{message}"
        );
    }
}

#[test]
fn a_route_naming_an_invalid_table_adds_no_second_error() {
    let (_, _, key, _) = error(&format!(
        "[limits.l]\nalgorithm = \"token_bucket\"\nrate = 1\nburst = 0\n{}",
        "[[routes]]\nname = \"r\"\nrespond = {}\nlimits = [\"l\"]\n"
    ));
    assert_eq!(key, "limits.l.burst");
    let (_, _, key, _) = error(
        "[upstreams.app]\nurl = \"ftp://127.0.0.1:9000\"\n[[routes]]\nname = \"r\"\nupstream = \"app\"\n",
    );
    assert_eq!(key, "upstreams.app.url");
}

#[test]
fn a_refused_location_adds_no_error_that_location_is_missing() {
    let (_, _, key, message) = error(
        "[[routes]]\nname = \"r\"\nrespond = { status = 302, headers = { \"Location\" = 'https:$request_uri' } }\n",
    );
    assert_eq!(key, "routes[0].respond.headers.Location");
    assert!(message.contains("$request_uri the host"), "{message}");
}

#[test]
fn a_lockout_shorter_than_its_window_is_warned_about() {
    let limit = |algorithm: &str, lockout: &str| {
        format!(
            "[limits.login]\nalgorithm = \"{algorithm}\"\nlimit = 5\nwindow = \"15m\"\nlockout = \"{lockout}\"\n"
        )
    };
    let warned = |text: &str| parse(text).unwrap().warnings();
    let short = warned(&limit("fixed_window", "1m"));
    assert_eq!(short.len(), 1, "{short:?}");
    assert!(
        short[0].starts_with("limits.login.lockout: 1m is shorter than its window (15m)"),
        "{short:?}"
    );
    assert_eq!(warned(&limit("sliding_window", "5m")).len(), 1);
    assert!(warned(&limit("fixed_window", "15m")).is_empty());
    assert!(warned(&limit("sliding_window", "1h")).is_empty());
}

#[test]
fn an_unlimited_body_read_whole_is_warned_about() {
    let upstream = |keys: &str| {
        format!(
            "[upstreams.app]\nurl = \"http://127.0.0.1:8080\"\n{keys}\n\n\
             [[routes]]\nname = \"app\"\nupstream = \"app\"\npath_prefix = \"/\"\n"
        )
    };
    let warned = |text: &str| {
        let warnings = parse(text).unwrap().warnings();
        warnings
            .iter()
            .any(|w| w.starts_with("server.max_body: unlimited"))
    };
    assert!(warned(&upstream("max_requests = 4")));
    assert!(
        !warned(&upstream("")),
        "bodies stream to an upstream without a cap"
    );
    assert!(!warned(&format!(
        "[server]\nmax_body = \"8MB\"\n\n{}",
        upstream("max_requests = 4")
    )));
}
