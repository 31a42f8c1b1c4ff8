//! Redis Sentinel (`redis.sentinels` + `redis.master_name`): floodgate decides on the master
//! the sentinels name, and follows a failover when the master is killed mid-traffic. The
//! test starts a real master, replica and sentinel.

use crate::common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::config::GatewayToml;
use crate::common::redis_server::RedisServer;
use crate::common::{TestGateway, Upstream, get};
use http::StatusCode;

/// A `redis-server --sentinel` watching one master, killed on drop.
struct Sentinel {
    port: u16,
    child: Child,
    _dir: tempfile::TempDir,
}

impl Sentinel {
    fn start(master_port: u16) -> Sentinel {
        let dir = tempfile::tempdir().unwrap();
        let port = common::closed_port();
        let conf = dir.path().join("sentinel.conf");
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {}\nsentinel monitor mymaster 127.0.0.1 {master_port} 1\n\
                 sentinel down-after-milliseconds mymaster 500\nsentinel failover-timeout mymaster 2000\n",
                dir.path().display()
            ),
        )
        .unwrap();
        let child = Command::new("redis-server")
            .arg(&conf)
            .arg("--sentinel")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server --sentinel");
        let sentinel = Sentinel {
            port,
            child,
            _dir: dir,
        };
        sentinel.wait_until(Duration::from_secs(5), |s| s.ask(&["ping"]).trim() == "PONG");
        sentinel
    }

    fn ask(&self, args: &[&str]) -> String {
        let output = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .unwrap();
        String::from_utf8_lossy(&output.stdout).into_owned()
    }

    fn master_port(&self) -> String {
        let answer = self.ask(&["sentinel", "get-master-addr-by-name", "mymaster"]);
        answer.lines().nth(1).unwrap_or("").trim().to_owned()
    }

    fn wait_until(&self, limit: Duration, condition: impl Fn(&Sentinel) -> bool) {
        let started = Instant::now();
        while !condition(self) {
            assert!(
                started.elapsed() < limit,
                "sentinel condition not met within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn floodgate_follows_a_sentinel_failover() {
    let (mut master, replica, sentinel) = tokio::task::spawn_blocking(|| {
        let master = RedisServer::start();
        let replica = RedisServer::start_with(&["--replicaof", "127.0.0.1", &master.port.to_string()]);
        let sentinel = Sentinel::start(master.port);
        // The sentinel must know the replica (and it must be in sync) before a failover.
        sentinel.wait_until(Duration::from_secs(15), |s| {
            s.ask(&["sentinel", "replicas", "mymaster"])
                .contains(&replica.port.to_string())
        });
        (master, replica, sentinel)
    })
    .await
    .unwrap();

    let upstream = Upstream::start().await;
    let gateway = TestGateway::start(
        GatewayToml::new()
            .table(
                "redis",
                &format!(
                    r#"sentinels = ["redis://127.0.0.1:{}"]
                    master_name = "mymaster"
                    timeout = "100ms"
                    on_error = "deny""#,
                    sentinel.port
                ),
            )
            .upstream("app", &upstream.url(), "")
            .limit(
                "quota",
                r#"algorithm = "fixed_window"
                limit = 1000000
                window = "1m""#,
            )
            .route(
                "r",
                r#"upstream = "app"
                limits = ["quota"]"#,
            ),
    )
    .await;
    // The gateway waits a second at most for its first connection (through the sentinel,
    // then to the master) before it serves; on a loaded machine it may come later.
    let connected = Instant::now();
    while get(&gateway.url("/before")).await.0 != StatusCode::OK {
        assert!(connected.elapsed() < Duration::from_secs(10), "never connected");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        master.cli(&["--scan"]).contains("floodgate:"),
        "decided on the master"
    );

    tokio::task::block_in_place(|| master.kill());
    let killed = Instant::now();
    // Traffic continues; floodgate refuses (deny) until the sentinel has promoted the
    // replica, then decides there again.
    loop {
        let status = get(&gateway.url("/during")).await.0;
        if status == StatusCode::OK {
            break;
        }
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert!(
            killed.elapsed() < Duration::from_secs(20),
            "no failover followed within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let recovered = killed.elapsed();
    assert_eq!(
        sentinel.master_port(),
        replica.port.to_string(),
        "the replica was promoted"
    );
    assert!(
        replica.cli(&["--scan"]).contains("floodgate:"),
        "decided on the new master"
    );
    eprintln!("floodgate decided on the new master {recovered:?} after the old one was killed");
}
