//! Redis Cluster (`redis.cluster = true`): against a real 3-master cluster started by
//! the test, limits that share a key tuple share a slot and are decided in one atomic
//! call; limits in different slots are decided per slot, and what one slot consumed is
//! given back when another slot refuses.

use std::process::Command;
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

use crate::common::config::GatewayToml;
use crate::common::redis_server::RedisServer;
use crate::common::{TestGateway, Upstream, send};
use http::{Request, StatusCode};

/// A free port whose cluster bus port (+10000) is free too; cluster ports must be ≤ 55535.
/// Each call tries ports no other call of this process tried: two clusters starting at
/// once would otherwise both find the same port free.
fn cluster_port() -> u16 {
    static TRIED: AtomicU16 = AtomicU16::new(0);
    let seed = std::process::id() as u16;
    (0..5000u16)
        .map(|_| {
            let i = TRIED.fetch_add(1, Ordering::Relaxed);
            20000 + (seed.wrapping_add(i.wrapping_mul(7919))) % 35000
        })
        .find(|&port| {
            std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
                && std::net::TcpListener::bind(("127.0.0.1", port + 10000)).is_ok()
        })
        .expect("a free cluster port")
}

struct Cluster {
    nodes: Vec<RedisServer>,
}

impl Cluster {
    fn start() -> Cluster {
        let args = [
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            "2000",
        ];
        let mut nodes: Vec<RedisServer> = Vec::new();
        while nodes.len() < 3 {
            let port = cluster_port();
            if nodes.iter().all(|n| n.port != port) {
                nodes.push(RedisServer::start_on(port, &args));
            }
        }
        let addresses: Vec<String> = nodes.iter().map(|n| format!("127.0.0.1:{}", n.port)).collect();
        let output = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addresses)
            .args(["--cluster-replicas", "0", "--cluster-yes"])
            .output()
            .expect("redis-cli --cluster create");
        assert!(
            output.status.success(),
            "{}",
            String::from_utf8_lossy(&output.stdout)
        );
        let started = Instant::now();
        while !nodes
            .iter()
            .all(|n| n.cli(&["cluster", "info"]).contains("cluster_state:ok"))
        {
            assert!(
                started.elapsed() < Duration::from_secs(15),
                "the cluster did not become ok"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        Cluster { nodes }
    }

    /// The URL of its first node, through which the gateway finds the others.
    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.nodes[0].port)
    }

    fn slot(&self, tag: &str) -> String {
        self.nodes[0].cli(&["cluster", "keyslot", tag]).trim().to_owned()
    }

    /// Whether node `index` serves the slot of `x-api-key` value `key`.
    fn serves(&self, index: usize, key: &str) -> bool {
        let slot: u32 = self.slot(&format!("v{key}")).parse().unwrap();
        self.nodes[index]
            .cli(&["cluster", "nodes"])
            .lines()
            .any(|line| line.contains("myself") && owns(line, slot))
    }

    fn keys(&self) -> Vec<String> {
        self.nodes
            .iter()
            .flat_map(|n| n.cli(&["--scan"]).lines().map(str::to_owned).collect::<Vec<_>>())
            .collect()
    }
}

/// `[redis]` keys for deciding on the cluster within `timeout`, refusing when it fails.
fn deciding(timeout: &str) -> String {
    format!("cluster = true\ntimeout = \"{timeout}\"\non_error = \"deny\"")
}

/// A gateway deciding on `cluster` (which serves what it can when a node is lost) a
/// fixed window of 1000 a minute per `x-api-key`, refusing when Redis fails; under
/// `/both`, also one per `x-tenant` (a decision across two slots).
async fn per_key_gateway(cluster: &Cluster) -> (Upstream, TestGateway) {
    for node in &cluster.nodes {
        node.cli(&["config", "set", "cluster-require-full-coverage", "no"]);
    }
    let upstream = Upstream::start().await;
    let gateway = TestGateway::start(
        GatewayToml::new()
            .redis(&cluster.url(), &deciding("300ms"))
            .upstream("app", &upstream.url(), "")
            .limit(
                "per_key",
                r#"algorithm = "fixed_window"
                limit = 1000
                window = "1m"
                key = ["header:x-api-key"]"#,
            )
            .limit(
                "per_tenant",
                r#"algorithm = "fixed_window"
                limit = 1000
                window = "1m"
                key = ["header:x-tenant"]"#,
            )
            .route(
                "both",
                r#"path_prefix = "/both"
                upstream = "app"
                limits = ["per_key", "per_tenant"]"#,
            )
            .route(
                "app",
                r#"upstream = "app"
                limits = ["per_key"]"#,
            ),
    )
    .await;
    (upstream, gateway)
}

/// The status of a request under `/both` for `api_key` and `tenant`.
async fn request_both(gateway: &TestGateway, api_key: &str, tenant: &str) -> StatusCode {
    let request = Request::get(gateway.url("/both"))
        .header("x-api-key", api_key)
        .header("x-tenant", tenant)
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    send(request).await.0
}

async fn request(gateway: &TestGateway, api_key: &str) -> (StatusCode, String) {
    let request = Request::get(gateway.url("/x"))
        .header("x-api-key", api_key)
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let (status, headers, _) = send(request).await;
    let ratelimit = headers
        .get("ratelimit")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (status, ratelimit)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_decisions_same_slot_and_across_slots() {
    let cluster = tokio::task::spawn_blocking(Cluster::start).await.unwrap();
    // The two key tuples this test uses must live in different slots.
    assert_ne!(cluster.slot("i127.0.0.1"), cluster.slot("vkey-one"));
    let upstream = Upstream::start().await;
    let gateway = TestGateway::start(
        GatewayToml::new()
            .redis(&cluster.url(), &deciding("500ms"))
            .upstream("app", &upstream.url(), "")
            .limit(
                "wide",
                r#"algorithm = "fixed_window"
                limit = 10
                window = "1m""#,
            )
            .limit(
                "narrow_ip",
                r#"algorithm = "fixed_window"
                limit = 3
                window = "1m""#,
            )
            .limit(
                "per_key",
                r#"algorithm = "fixed_window"
                limit = 2
                window = "1m"
                key = ["header:x-api-key"]"#,
            )
            .route(
                "same-slot",
                r#"host = "same.test"
                upstream = "app"
                limits = ["wide", "narrow_ip"]"#,
            )
            .route(
                "cross-slot",
                r#"upstream = "app"
                limits = ["wide", "per_key"]"#,
            ),
    )
    .await;

    // Same key tuple: one slot, one atomic call, all or nothing.
    let same = |n: u32| {
        let url = gateway.url("/x");
        async move {
            let request = Request::get(url)
                .header("host", "same.test")
                .body(http_body_util::Full::new(bytes::Bytes::new()))
                .unwrap();
            let (status, headers, _) = send(request).await;
            (
                status,
                headers.get("ratelimit").map(|v| v.to_str().unwrap().to_owned()),
                n,
            )
        }
    };
    for n in 0..3 {
        assert_eq!(same(n).await.0, StatusCode::OK);
    }
    let (status, ratelimit, _) = same(3).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(ratelimit.unwrap(), "\"wide\";r=7;t=60, \"narrow_ip\";r=0;t=60");

    // Different tuples: `wide` (client IP) and `per_key` (API key) live in two slots.
    assert_eq!(request(&gateway, "key-one").await.0, StatusCode::OK);
    assert_eq!(request(&gateway, "key-one").await.0, StatusCode::OK);
    let (status, ratelimit) = request(&gateway, "key-one").await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    // `wide` admitted in its slot, then gave it back because `per_key` refused: 3 + 2 used.
    assert!(ratelimit.starts_with("\"wide\";r=5;"), "{ratelimit}");
    let (status, ratelimit) = request(&gateway, "key-two").await;
    assert_eq!(status, StatusCode::OK);
    assert!(ratelimit.starts_with("\"wide\";r=4;"), "{ratelimit}");
    assert_eq!(upstream.requests(), 6);

    let keys = cluster.keys();
    assert!(
        keys.iter().any(|k| k.contains("{i127.0.0.1}:wide:fw")),
        "{keys:?}"
    );
    assert!(
        keys.iter().any(|k| k.contains("{vkey-one}:per_key:fw")),
        "{keys:?}"
    );
}

/// The node that holds the instances' heartbeat key going down leaves the other nodes'
/// keys decided in Redis: the breaker's probe on a cluster is a `PING`, which the live
/// nodes answer, not the heartbeat, whose one node is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_heartbeats_node_leaves_the_other_keys_decided() {
    let mut cluster = tokio::task::spawn_blocking(Cluster::start).await.unwrap();
    let (_upstream, gateway) = per_key_gateway(&cluster).await;
    let heartbeat_slot = cluster.slot("floodgate:instances");
    let started = Instant::now();
    let holder = loop {
        let holder = cluster
            .nodes
            .iter()
            .position(|node| node.cli(&["cluster", "countkeysinslot", &heartbeat_slot]).trim() == "1");
        if let Some(holder) = holder {
            break holder;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "no heartbeat in the cluster"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // A key whose slot a node other than the heartbeat's serves.
    let live = (0..1000)
        .map(|i| format!("key-{i}"))
        .find(|key| !cluster.serves(holder, key))
        .expect("a key on another node");
    assert_eq!(request(&gateway, &live).await.0, StatusCode::OK);

    tokio::task::block_in_place(|| cluster.nodes[holder].kill());
    // No traffic for a while: only the probe speaks to the cluster.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let started = Instant::now();
    loop {
        if request(&gateway, &live).await.0 == StatusCode::OK {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "a live node's key is refused: the breaker stays open"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether a `CLUSTER NODES` line's node serves `slot`.
fn owns(line: &str, slot: u32) -> bool {
    line.split(' ').skip(8).any(|range| match range.split_once('-') {
        Some((from, to)) => (from.parse().unwrap_or(u32::MAX)..=to.parse().unwrap_or(0)).contains(&slot),
        None => range.parse() == Ok(slot),
    })
}

/// A node going down sends only its own keys to `on_error` (here `deny`: `503`): every
/// request for a key another node serves is still decided in Redis, counted exactly, while
/// the lost node's keys fail. One breaker for the whole cluster opened on the lost node's
/// failures and refused the live nodes' keys with them until a `PING` closed it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_node_sends_only_its_own_keys_to_on_error() {
    let mut cluster = tokio::task::spawn_blocking(Cluster::start).await.unwrap();
    let (_upstream, gateway) = per_key_gateway(&cluster).await;
    let key_on = |index: usize| {
        (0..1000)
            .map(|i| format!("key-{i}"))
            .find(|key| cluster.serves(index, key))
            .expect("a key on the node")
    };
    let (lost, live) = (key_on(1), key_on(2));
    assert_eq!(request(&gateway, &lost).await.0, StatusCode::OK);
    assert_eq!(request(&gateway, &live).await.0, StatusCode::OK);
    // The gateway reads which node serves which slot every second, the first time about
    // a second after it starts: two more leave a loaded machine room.
    tokio::time::sleep(Duration::from_millis(2500)).await;

    tokio::task::block_in_place(|| cluster.nodes[1].kill());
    // Decisions across the lost node's slot and a live one's fail for the lost node only
    // (opening its breaker), not for the live node, which goes on deciding its keys.
    for _ in 0..3 {
        assert_eq!(
            request_both(&gateway, &lost, &live).await,
            StatusCode::SERVICE_UNAVAILABLE,
            "across a lost node's slot"
        );
    }
    let (status, _) = request(&gateway, &live).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "a live node's key after decisions across slots"
    );
    for round in 0..5 {
        // Enough failures in a row to open a breaker.
        for _ in 0..3 {
            assert_eq!(
                request(&gateway, &lost).await.0,
                StatusCode::SERVICE_UNAVAILABLE,
                "round {round}: a lost node's key"
            );
        }
        let (status, ratelimit) = request(&gateway, &live).await;
        assert_eq!(status, StatusCode::OK, "round {round}: a live node's key");
        // Decided in Redis, one more each time: the first two requests, then one a round.
        let counted = format!("\"per_key\";r={};", 997 - round);
        assert!(ratelimit.starts_with(&counted), "round {round}: {ratelimit}");
    }
}

/// A node that comes back (restarted with its cluster configuration, after the others
/// marked it failed) is asked again: its keys are decided in Redis from then on, and its
/// breaker closes once and stays closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_node_is_asked_again_once_it_serves_its_slots() {
    let mut cluster = tokio::task::spawn_blocking(Cluster::start).await.unwrap();
    let (_upstream, gateway) = per_key_gateway(&cluster).await;
    let lost = (0..1000)
        .map(|i| format!("key-{i}"))
        .find(|key| cluster.serves(1, key))
        .expect("a key on the node");
    assert_eq!(request(&gateway, &lost).await.0, StatusCode::OK);
    // The slot map, read every second (see above).
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let open = "floodgate_store_breaker_open{store=\"redis\"}";

    tokio::task::block_in_place(|| cluster.nodes[1].kill());
    while gateway.metric(open).await != 1.0 {
        assert_eq!(request(&gateway, &lost).await.0, StatusCode::SERVICE_UNAVAILABLE);
    }
    // Down long enough for the others to mark it failed: back, it must rejoin before it
    // serves its slots again.
    tokio::time::sleep(Duration::from_secs(3)).await;
    tokio::task::block_in_place(|| cluster.nodes[1].restart());
    let restarted = Instant::now();
    let (mut closings, mut was_open, mut served) = (0, true, None::<Instant>);
    // Watched until two seconds after its key was first decided again.
    while served.is_none_or(|at| at.elapsed() < Duration::from_secs(2)) {
        assert!(
            restarted.elapsed() < Duration::from_secs(20),
            "the restarted node's key was never decided again"
        );
        let now_open = gateway.metric(open).await == 1.0;
        closings += usize::from(was_open && !now_open);
        was_open = now_open;
        let (status, _) = request(&gateway, &lost).await;
        match (status, served) {
            (StatusCode::OK, None) => served = Some(Instant::now()),
            (StatusCode::OK, Some(_)) => {}
            (status, Some(at)) => panic!("{status} {:?} after the key was decided again", at.elapsed()),
            (_, None) => {}
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(closings, 1, "the breaker closed once, and stayed closed");
    assert!(!was_open);
}
