//! The shipped dashboard and alerts (monitoring/, docs/operations.md#dashboards-and-alerts):
//! promtool accepts the alerting rules, passes their unit tests and accepts the compose
//! example's Prometheus configuration; the dashboard's queries are PromQL over its own
//! variables; every metric the dashboard and the rules name is one a running floodgate
//! exports; and the compose example mounts those files and scrapes the admin listener where
//! it listens. promtool comes with Debian's `prometheus` package (`bash .ci/run` installs
//! it): without it these tests fail, they never skip.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::config::GatewayToml;
use crate::common::process::FloodgateProcess;
use crate::common::redis_server::RedisServer;
use crate::common::tls::TestCa;
use crate::common::{Upstream, get};
use http::StatusCode;
use serde_json::Value;

const DASHBOARD: &str = "monitoring/grafana/floodgate.json";
const ALERTS: &str = "monitoring/prometheus/alerts.yml";
const ALERTS_TEST: &str = "monitoring/prometheus/alerts_test.yml";
const PROMETHEUS_CONFIG: &str = "monitoring/prometheus/prometheus.yml";

/// Grafana's own variables that the dashboard may use, with a value for checking the
/// queries as PromQL.
const GRAFANA_VARIABLES: [(&str, &str); 4] = [
    ("__rate_interval", "5m"),
    ("__interval", "1m"),
    ("__range", "1h"),
    ("__range_s", "3600"),
];

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo().join(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Runs `promtool ARGS` in the repository; panics unless it succeeds.
fn promtool(args: &[&str]) -> String {
    let output = Command::new("promtool")
        .args(args)
        .current_dir(repo())
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run promtool ({e}): install Debian's `prometheus` package (bash .ci/run does)")
        });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        output.status.success(),
        "promtool {args:?}: {}\n{text}",
        output.status
    );
    text
}

#[test]
fn promtool_accepts_the_rules_and_their_unit_tests_pass() {
    promtool(&["check", "rules", ALERTS]);
    promtool(&["test", "rules", ALERTS_TEST]);
}

#[test]
fn promtool_accepts_the_compose_prometheus_config_with_its_rules() {
    // The rule file is named relative to prometheus.yml, so it resolves here as in the
    // container (where the directory is mounted whole) and is checked along.
    let checked = promtool(&["check", "config", PROMETHEUS_CONFIG]);
    assert!(checked.contains("SUCCESS: 1 rule files found"), "{checked}");
}

/// The dashboard, parsed.
fn dashboard() -> Value {
    serde_json::from_str(&read(DASHBOARD)).unwrap_or_else(|e| panic!("{DASHBOARD}: {e}"))
}

/// Every string under a key named `key`, anywhere in `value`.
fn strings_under(value: &Value, key: &str, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (name, inner) in map {
                match inner {
                    Value::String(text) if name == key => out.push(text.clone()),
                    _ => strings_under(inner, key, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|item| strings_under(item, key, out)),
        _ => {}
    }
}

/// Every string in `value`, keys excluded.
fn all_strings(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::String(text) => out.push(text.clone()),
        Value::Object(map) => map.values().for_each(|inner| all_strings(inner, out)),
        Value::Array(items) => items.iter().for_each(|item| all_strings(item, out)),
        _ => {}
    }
}

/// The dashboard's panel queries.
fn dashboard_exprs(dashboard: &Value) -> Vec<String> {
    let mut exprs = Vec::new();
    strings_under(dashboard, "expr", &mut exprs);
    exprs
}

/// The `$name` and `${name}` references in `text`, with their byte ranges.
fn variable_references(text: &str) -> Vec<(std::ops::Range<usize>, String)> {
    let bytes = text.as_bytes();
    let mut found = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'$' {
            i += 1;
            continue;
        }
        let braced = bytes.get(i + 1) == Some(&b'{');
        let start = if braced { i + 2 } else { i + 1 };
        let mut end = start;
        while end < bytes.len() && (bytes[end].is_ascii_alphanumeric() || bytes[end] == b'_') {
            end += 1;
        }
        let closed = !braced || bytes.get(end) == Some(&b'}');
        if end > start && closed {
            let stop = if braced { end + 1 } else { end };
            found.push((i..stop, text[start..end].to_owned()));
            i = stop;
        } else {
            i += 1;
        }
    }
    found
}

#[test]
fn the_dashboard_queries_are_promql_over_its_own_variables() {
    let dashboard = dashboard();
    assert!(dashboard["schemaVersion"].as_u64().is_some(), "no schemaVersion");
    let variables = dashboard["templating"]["list"]
        .as_array()
        .expect("templating.list");
    let datasource = variables
        .iter()
        .find(|v| v["name"] == "datasource")
        .expect("a datasource variable");
    assert_eq!(
        (&datasource["type"], &datasource["query"]),
        (&Value::from("datasource"), &Value::from("prometheus"))
    );
    let names: BTreeSet<&str> = variables.iter().filter_map(|v| v["name"].as_str()).collect();
    for wanted in ["route", "upstream"] {
        let variable = variables.iter().find(|v| v["name"] == wanted).expect(wanted);
        assert_eq!(variable["type"], "query", "{wanted}");
        assert!(
            variable["definition"]
                .as_str()
                .is_some_and(|d| d.starts_with("label_values(floodgate_")),
            "{wanted}: {variable}"
        );
    }

    // Every panel and query reads the chosen data source; panel ids are unique.
    let mut ids = BTreeSet::new();
    let mut uids = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        assert!(
            ids.insert(panel["id"].as_u64().expect("panel id")),
            "id {}",
            panel["id"]
        );
        if panel["type"] == "row" {
            continue;
        }
        strings_under(panel, "uid", &mut uids);
        assert!(
            panel["targets"].as_array().is_some_and(|t| !t.is_empty()),
            "{} has no query",
            panel["title"]
        );
    }
    strings_under(&dashboard["templating"], "uid", &mut uids);
    assert!(uids.iter().all(|uid| uid == "${datasource}"), "{uids:?}");

    // The queries with each variable replaced by a value are PromQL: promtool checks them
    // as recording rules.
    let exprs = dashboard_exprs(&dashboard);
    assert!(exprs.len() >= 15, "only {} queries found", exprs.len());
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (n, expr) in exprs.iter().enumerate() {
        let mut promql = expr.clone();
        for (range, name) in variable_references(expr).into_iter().rev() {
            let value = if let Some((_, value)) = GRAFANA_VARIABLES.iter().find(|(v, _)| *v == name) {
                *value
            } else if names.contains(name.as_str()) && name != "datasource" {
                ".*"
            } else if name.bytes().all(|b| b.is_ascii_digit()) {
                continue; // a regex group in label_replace's replacement
            } else {
                panic!("{expr}: ${name} is no variable of the dashboard");
            };
            promql.replace_range(range, value);
        }
        let quoted = serde_json::to_string(&promql).unwrap();
        rules.push_str(&format!(
            "      - record: dashboard_query_{n}\n        expr: {quoted}\n"
        ));
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("dashboard_queries.yml");
    std::fs::write(&file, &rules).unwrap();
    promtool(&["check", "rules", file.to_str().unwrap()]);
}

/// The `floodgate_...` metric names in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let bytes = text.as_bytes();
    let mut names = BTreeSet::new();
    for (start, _) in text.match_indices("floodgate_") {
        let previous = start.checked_sub(1).map(|i| bytes[i]);
        if previous.is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b':') {
            continue;
        }
        let end = text[start..]
            .find(|c: char| !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'))
            .map_or(text.len(), |n| start + n);
        names.insert(text[start..end].to_owned());
    }
    names
}

/// The series names each `# TYPE NAME KIND` line of `exposition` stands for, as
/// prometheus-client 0.25 writes them (and Prometheus stores them): a counter's samples
/// are `NAME_total`, a histogram's `NAME_bucket`, `NAME_sum` and `NAME_count`, an info
/// metric's `NAME_info`, a gauge's `NAME`. Families without series are left out of the
/// exposition altogether, TYPE line included.
fn exported_series(exposition: &str) -> BTreeMap<String, String> {
    let mut series = BTreeMap::new();
    for line in exposition.lines() {
        let Some(rest) = line.strip_prefix("# TYPE ") else {
            continue;
        };
        let (name, kind) = rest.split_once(' ').expect("# TYPE NAME KIND");
        let suffixes: &[&str] = match kind {
            "counter" => &["_total"],
            "histogram" => &["_bucket", "_sum", "_count"],
            "info" => &["_info"],
            _ => &[""],
        };
        for suffix in suffixes {
            series.insert(format!("{name}{suffix}"), line.to_owned());
        }
    }
    series
}

#[test]
fn exported_series_are_what_prometheus_client_writes_for_each_kind() {
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;
    use prometheus_client::metrics::gauge::Gauge;
    use prometheus_client::metrics::histogram::Histogram;
    use prometheus_client::metrics::info::Info;

    type Labels = Vec<(&'static str, &'static str)>;
    let mut registry = prometheus_client::registry::Registry::default();
    let counters = Family::<Labels, Counter>::default();
    counters.get_or_create(&vec![("route", "app")]).inc();
    registry.register("floodgate_a", "A counter family", counters);
    registry.register("floodgate_b", "A counter", Counter::<u64>::default());
    let histograms: Family<Labels, Histogram, fn() -> Histogram> =
        Family::new_with_constructor(|| Histogram::new([0.1, 1.0]));
    histograms.get_or_create(&vec![("store", "redis")]).observe(0.5);
    registry.register("floodgate_c_seconds", "A histogram family", histograms);
    registry.register("floodgate_d", "A gauge", Gauge::<i64>::default());
    registry.register("floodgate_e", "An info metric", Info::new(vec![("version", "1")]));
    registry.register(
        "floodgate_f",
        "An empty family",
        Family::<Labels, Gauge>::default(),
    );
    let mut exposition = String::new();
    prometheus_client::encoding::text::encode(&mut exposition, &registry).unwrap();

    let exported = exported_series(&exposition);
    let names: Vec<&str> = exported.keys().map(String::as_str).collect();
    assert_eq!(
        names,
        [
            "floodgate_a_total",
            "floodgate_b_total",
            "floodgate_c_seconds_bucket",
            "floodgate_c_seconds_count",
            "floodgate_c_seconds_sum",
            "floodgate_d",
            "floodgate_e_info",
        ],
        "{exposition}"
    );
    // Each is a sample name of the exposition (an empty family has neither samples nor TYPE).
    for name in names {
        assert!(
            exposition
                .lines()
                .any(|line| line.starts_with(&format!("{name}{{")) || line.starts_with(&format!("{name} "))),
            "{name} in\n{exposition}"
        );
    }

    let used = metric_names(
        "sum(rate(floodgate_a_total{route=~\"$route\"}[5m])) / x_floodgate_no + floodgate_c_seconds_bucket{le=\"1\"}",
    );
    assert_eq!(
        used,
        BTreeSet::from([
            "floodgate_a_total".to_owned(),
            "floodgate_c_seconds_bucket".to_owned()
        ])
    );
}

/// The values a `LABEL="a"` or `LABEL=~"a|b"` matcher in `text` names (plain words only).
fn matched_values(text: &str, label: &str) -> BTreeSet<String> {
    let mut values = BTreeSet::new();
    for operator in ["=\"", "=~\""] {
        let pattern = format!("{label}{operator}");
        for (start, _) in text.match_indices(&pattern) {
            let rest = &text[start + pattern.len()..];
            let value = &rest[..rest.find('"').expect("a closing quote")];
            values.extend(
                value
                    .split('|')
                    .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'))
                    .map(str::to_owned),
            );
        }
    }
    values
}

/// GETs the admin `/metrics` until it holds every one of `wanted` or 10 s pass.
async fn metrics_with(gateway: &FloodgateProcess, wanted: &[&str]) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (status, _, body) = get(&gateway.admin_url("/metrics")).await;
        assert_eq!(status, StatusCode::OK);
        if wanted.iter().all(|w| body.contains(w)) || Instant::now() > deadline {
            return body;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboard_and_the_rules_name_is_exported() {
    // A gateway with what every family needs to have series: Redis as the store, an
    // upstream of two servers under max_requests, a route with a limit, an HTTPS listener
    // (the certificate's expiry) with ACME (its attempts), and a reload.
    let redis = RedisServer::start();
    let (a, b) = (Upstream::start().await, Upstream::start().await);
    let certificates = tempfile::tempdir().unwrap();
    let (cert, key) = TestCa::new("monitoring test CA")
        .issue(&["monitoring.test"])
        .write(certificates.path(), "site");
    let config = GatewayToml::new()
        .table(
            "server.tls",
            &format!(
                "listen = \"127.0.0.1:0\"\ncertificates = [{{ cert = {:?}, key = {:?} }}]",
                cert.to_str().unwrap(),
                key.to_str().unwrap()
            ),
        )
        // ACME from a CA that is not there: its attempts are counted (kept in Redis).
        .table(
            "server.tls.acme",
            "directory = \"https://127.0.0.1:1/directory\"\ndomains = [\"monitoring.test\"]",
        )
        .redis(&redis.url(), "on_error = \"allow\"")
        .table(
            "upstreams.app",
            &format!(
                "servers = [\"{}\", \"{}\"]\nmax_requests = 4\nqueue = 10\nqueue_timeout = \"1s\"",
                a.url(),
                b.url()
            ),
        )
        .limit(
            "per_ip",
            "algorithm = \"fixed_window\"\nlimit = 100\nwindow = \"1m\"\nkey = [\"client_ip\"]",
        )
        .route(
            "app",
            "path_prefix = \"/\"\nupstream = \"app\"\nlimits = [\"per_ip\"]",
        );
    let gateway = FloodgateProcess::start(config, &[]);
    for path in ["/one", "/two", "/three"] {
        assert_eq!(get(&gateway.url(path)).await.0, StatusCode::OK, "{path}");
    }
    // A changed file is reloaded (the watcher is in place once the gateway answers; a
    // SIGHUP could come before its handler).
    let mut text = std::fs::read_to_string(&gateway.config).unwrap();
    text.push_str("# changed, to be reloaded\n");
    std::fs::write(&gateway.config, text).unwrap();
    let exposition = metrics_with(
        &gateway,
        &[
            "floodgate_requests_total{route=\"app\"",
            "floodgate_config_reloads_total{",
        ],
    )
    .await;
    let exported = exported_series(&exposition);

    let dashboard = dashboard();
    let mut dashboard_text = Vec::new();
    all_strings(&dashboard, &mut dashboard_text);
    let alerts = read(ALERTS);
    let mut used: BTreeMap<String, BTreeSet<&str>> = BTreeMap::new();
    for (source, text) in [(DASHBOARD, dashboard_text.join("\n")), (ALERTS, alerts.clone())] {
        for name in metric_names(&text) {
            used.entry(name).or_default().insert(source);
        }
    }
    for expr in dashboard_exprs(&dashboard) {
        assert!(
            !metric_names(&expr).is_empty(),
            "a query without a floodgate metric: {expr}"
        );
    }
    assert!(
        used.len() >= 15,
        "only {} metric names found: {used:?}",
        used.len()
    );

    let missing: Vec<String> = used
        .iter()
        .filter(|(name, _)| !exported.contains_key(name.as_str()))
        .map(|(name, sources)| {
            format!(
                "{name} (in {})",
                sources.iter().copied().collect::<Vec<_>>().join(", ")
            )
        })
        .collect();
    let type_lines: Vec<&str> = exposition.lines().filter(|l| l.starts_with("# TYPE ")).collect();
    assert!(
        missing.is_empty(),
        "named in the dashboard or the rules but not exported by floodgate:\n  {}\n\nexported:\n  {}",
        missing.join("\n  "),
        type_lines.join("\n  ")
    );

    // The upstream failure kinds the rules and the dashboard match are kinds floodgate
    // counts (each upstream has a series of every kind from the start).
    let kinds = matched_values(&format!("{alerts}\n{}", dashboard_text.join("\n")), "kind");
    assert!(
        kinds.contains("queue_full") && kinds.contains("queue_timeout"),
        "{kinds:?}"
    );
    for kind in kinds {
        assert!(
            exposition.contains(&format!("kind=\"{kind}\"")),
            "kind {kind:?} is not a label value of floodgate_upstream_errors_total:\n{exposition}"
        );
    }
}

/// The compose example's files: what it mounts from monitoring/ exists, Prometheus scrapes
/// the admin listener on the port it binds beyond the container's loopback, Grafana reads
/// the dashboard where the provisioning looks.
#[test]
fn the_compose_example_mounts_the_monitoring_files_and_scrapes_the_admin_listener() {
    let compose_dir = repo().join("examples/compose");
    let compose = read("examples/compose/docker-compose.yml");
    let mut mounts = BTreeMap::new();
    for line in compose.lines() {
        let Some(mount) = line.trim().strip_prefix("- ../../monitoring/") else {
            continue;
        };
        let mut parts = mount.split(':');
        let (source, target) = (parts.next().unwrap(), parts.next().expect("a mount target"));
        assert!(
            compose_dir.join("../../monitoring").join(source).exists(),
            "docker-compose.yml mounts monitoring/{source}, which does not exist"
        );
        mounts.insert(target.to_owned(), format!("monitoring/{source}"));
    }
    for line in [
        "image: prom/prometheus",
        "image: grafana/grafana",
        "profiles: [\"monitoring\"]",
        "- --config.file=/etc/prometheus/floodgate/prometheus.yml\n",
        "- \"127.0.0.1:3000:3000\"\n",
        "GF_AUTH_ANONYMOUS_ENABLED: \"true\"\n",
        "GF_AUTH_ANONYMOUS_ORG_ROLE: Viewer\n",
        "docker compose --profile monitoring up --build\n",
    ] {
        assert!(compose.contains(line), "docker-compose.yml: no {line:?}");
    }
    let mounted = |target: &str| {
        mounts
            .get(target)
            .unwrap_or_else(|| panic!("nothing mounted at {target}"))
    };
    assert_eq!(mounted("/etc/prometheus/floodgate"), "monitoring/prometheus");
    assert_eq!(mounted("/etc/grafana/dashboards/floodgate.json"), DASHBOARD);
    for provisioning in ["datasources", "dashboards"] {
        assert_eq!(
            mounted(&format!("/etc/grafana/provisioning/{provisioning}")),
            &format!("monitoring/grafana/provisioning/{provisioning}")
        );
    }
    let provider = read("monitoring/grafana/provisioning/dashboards/floodgate.yml");
    assert!(provider.contains("path: /etc/grafana/dashboards\n"), "{provider}");
    let datasource = read("monitoring/grafana/provisioning/datasources/prometheus.yml");
    assert!(
        datasource.contains("url: http://prometheus:9090\n"),
        "{datasource}"
    );
    assert!(compose.contains("\n  prometheus:\n") && compose.contains("\n  floodgate:\n"));

    // Prometheus scrapes floodgate:PORT, the port of the example's admin_listen, which
    // binds every address of the container (another container cannot reach its loopback).
    let gateway: toml::Table = toml::from_str(&read("examples/compose/gateway.toml")).unwrap();
    let admin: std::net::SocketAddr = gateway["server"]["admin_listen"]
        .as_str()
        .expect("admin_listen")
        .parse()
        .unwrap();
    assert!(
        admin.ip().is_unspecified(),
        "admin_listen = {admin}: unreachable from Prometheus"
    );
    let prometheus = read(PROMETHEUS_CONFIG);
    let target = format!("targets: [\"floodgate:{}\"]", admin.port());
    assert!(prometheus.contains(&target), "no {target} in {PROMETHEUS_CONFIG}");
    assert!(
        prometheus.contains("rule_files:\n  - alerts.yml\n"),
        "{prometheus}"
    );
}
