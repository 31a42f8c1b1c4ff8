//! Where ACME state lives: on disk under `storage` without `[redis]`, in Redis with it, so
//! that every instance shares one account, one certificate and its key, the pending
//! challenges (any instance answers the CA) and the lock that lets one instance order at a
//! time. The account and the certificate have no TTL (the one exception to the rule that
//! every floodgate key has one); challenges, the lock and the retry time do.

use std::path::{Path, PathBuf};
use std::time::Duration;

use redis::Script;
use tokio::sync::Mutex;

use crate::config::RedisConfig;
use crate::limit::redis::StoreError;
use crate::limit::redis::connection::{Connection, Source};

/// How long one storage operation may take.
const TIMEOUT: Duration = Duration::from_secs(5);
/// How long a published challenge is kept: longer than any order takes.
const CHALLENGE_TTL: Duration = Duration::from_secs(3600);

/// A certificate chain and its key, as PEM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StoredCertificate {
    pub(crate) chain: String,
    pub(crate) key: String,
}

/// What a challenge proves, and so how it is looked up.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Challenge {
    /// `http-01`: the token in `/.well-known/acme-challenge/TOKEN`.
    Http(String),
    /// `tls-alpn-01`: the name asked for in a handshake offering `acme-tls/1`.
    TlsAlpn(String),
}

/// The ACME state of one certificate (one CA directory and one set of names).
pub(crate) struct Storage {
    /// Names the set's keys and files: the CA and the names, hashed.
    set: String,
    /// The account's: the CA's directory, hashed.
    account: String,
    place: Place,
}

enum Place {
    Disk {
        root: PathBuf,
        /// `root/<first name in order>-<set>`.
        directory: PathBuf,
    },
    Redis(Box<InRedis>),
}

struct InRedis {
    source: Source,
    /// Made on first use, and again after a failure to connect.
    connection: Mutex<Option<Connection>>,
    prefix: String,
    take_over: Script,
    let_go: Script,
}

/// Extends the lock's lease when `ARGV[1]` holds it (or takes it when free).
const TAKE_OVER_LUA: &str = r"
local holder = redis.call('GET', KEYS[1])
if holder == false or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
";
/// Deletes the lock when `ARGV[1]` holds it.
const LET_GO_LUA: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

impl Storage {
    /// The storage of `domains`' certificate from `directory`: in Redis with `redis`,
    /// else under `disk` (one of them is given: the configuration's validation sees to it).
    pub(crate) fn new(
        directory: &str,
        domains: &[String],
        disk: Option<&Path>,
        redis: Option<&RedisConfig>,
    ) -> Result<Storage, StoreError> {
        let account = hex_digest(directory.as_bytes());
        let mut sorted = domains.to_vec();
        sorted.sort();
        let set = hex_digest(format!("{directory}\n{}", sorted.join("\n")).as_bytes());
        let place = match (redis, disk) {
            (Some(redis), _) => Place::Redis(Box::new(InRedis {
                source: Source::new(&redis.target, TIMEOUT)?,
                connection: Mutex::new(None),
                prefix: redis.prefix.clone(),
                take_over: Script::new(TAKE_OVER_LUA),
                let_go: Script::new(LET_GO_LUA),
            })),
            (None, disk) => {
                let root = disk.map_or_else(|| PathBuf::from("acme"), Path::to_path_buf);
                Place::Disk {
                    directory: root.join(format!("{}-{set}", sorted[0])),
                    root,
                }
            }
        };
        Ok(Storage { set, account, place })
    }

    /// Whether other instances share this storage (and so the challenges and the lock).
    pub(crate) fn shared(&self) -> bool {
        matches!(self.place, Place::Redis(_))
    }

    /// Where it is, for logs.
    pub(crate) fn describe(&self) -> String {
        match &self.place {
            Place::Disk { directory, .. } => directory.display().to_string(),
            Place::Redis(redis) => format!("Redis, under {}:acme:", redis.prefix),
        }
    }

    /// The account's credentials (JSON), when one was made.
    pub(crate) async fn account(&self) -> Result<Option<String>, String> {
        match &self.place {
            Place::Disk { root, .. } => read(&root.join(format!("account-{}.json", self.account))),
            Place::Redis(_) => {
                self.redis(redis::cmd("GET").arg(self.key("account", &self.account)))
                    .await
            }
        }
    }

    pub(crate) async fn save_account(&self, credentials: &str) -> Result<(), String> {
        match &self.place {
            Place::Disk { root, .. } => write(root, &format!("account-{}.json", self.account), credentials),
            Place::Redis(_) => {
                self.redis(
                    redis::cmd("SET")
                        .arg(self.key("account", &self.account))
                        .arg(credentials),
                )
                .await
            }
        }
    }

    /// The certificate last obtained, by any instance.
    pub(crate) async fn certificate(&self) -> Result<Option<StoredCertificate>, String> {
        match &self.place {
            Place::Disk { directory, .. } => {
                let chain = read(&directory.join("certificate.pem"))?;
                let key = read(&directory.join("key.pem"))?;
                Ok(chain
                    .zip(key)
                    .map(|(chain, key)| StoredCertificate { chain, key }))
            }
            Place::Redis(_) => {
                let fields: Vec<Option<String>> = self
                    .redis(
                        redis::cmd("HMGET")
                            .arg(self.key("certificate", &self.set))
                            .arg("chain")
                            .arg("key"),
                    )
                    .await?;
                Ok(match <[Option<String>; 2]>::try_from(fields) {
                    Ok([Some(chain), Some(key)]) => Some(StoredCertificate { chain, key }),
                    _ => None,
                })
            }
        }
    }

    /// Stores `certificate` for every instance (on disk: the key first, each file replaced
    /// whole, so that a reader sees a mismatched pair at worst, which it refuses).
    pub(crate) async fn save_certificate(&self, certificate: &StoredCertificate) -> Result<(), String> {
        match &self.place {
            Place::Disk { directory, .. } => {
                write(directory, "key.pem", &certificate.key)?;
                write(directory, "certificate.pem", &certificate.chain)
            }
            Place::Redis(_) => {
                self.redis(
                    redis::cmd("HSET")
                        .arg(self.key("certificate", &self.set))
                        .arg("chain")
                        .arg(&certificate.chain)
                        .arg("key")
                        .arg(&certificate.key),
                )
                .await
            }
        }
    }

    /// Makes `key_authorization` the answer to `challenge` for every instance (in Redis;
    /// on disk, the instance's own memory answers).
    pub(crate) async fn publish(&self, challenge: &Challenge, key_authorization: &str) -> Result<(), String> {
        if !self.shared() {
            return Ok(());
        }
        self.redis(
            redis::cmd("SET")
                .arg(self.challenge_key(challenge))
                .arg(key_authorization)
                .arg("PX")
                .arg(CHALLENGE_TTL.as_millis() as u64),
        )
        .await
    }

    pub(crate) async fn withdraw(&self, challenge: &Challenge) -> Result<(), String> {
        if !self.shared() {
            return Ok(());
        }
        self.redis(redis::cmd("DEL").arg(self.challenge_key(challenge)))
            .await
    }

    /// What another instance published for `challenge`.
    pub(crate) async fn published(&self, challenge: &Challenge) -> Result<Option<String>, String> {
        if !self.shared() {
            return Ok(None);
        }
        self.redis(redis::cmd("GET").arg(self.challenge_key(challenge)))
            .await
    }

    /// Takes (or extends) the lock that lets one instance order, for `lease`; false when
    /// another instance holds it. On disk there is one instance: always true.
    pub(crate) async fn lock(&self, holder: &str, lease: Duration) -> Result<bool, String> {
        let Place::Redis(redis) = &self.place else {
            return Ok(true);
        };
        let mut invocation = redis.take_over.prepare_invoke();
        invocation
            .key(self.key("lock", &self.set))
            .arg(holder)
            .arg(lease.as_millis() as u64);
        let mut connection = self.connection().await?;
        let taken: u8 = within(invocation.invoke_async(&mut connection)).await?;
        Ok(taken == 1)
    }

    pub(crate) async fn unlock(&self, holder: &str) -> Result<(), String> {
        let Place::Redis(redis) = &self.place else {
            return Ok(());
        };
        let mut invocation = redis.let_go.prepare_invoke();
        invocation.key(self.key("lock", &self.set)).arg(holder);
        let mut connection = self.connection().await?;
        within(invocation.invoke_async::<u8>(&mut connection))
            .await
            .map(drop)
    }

    /// When the next attempt may be made after failures, and how many failed in a row.
    pub(crate) async fn retry(&self) -> Result<Option<(i64, u32)>, String> {
        let text = match &self.place {
            Place::Disk { directory, .. } => read(&directory.join("retry"))?,
            Place::Redis(_) => {
                self.redis(redis::cmd("GET").arg(self.key("retry", &self.set)))
                    .await?
            }
        };
        Ok(text.and_then(|text| {
            let (at, failures) = text.trim().split_once(' ')?;
            Some((at.parse().ok()?, failures.parse().ok()?))
        }))
    }

    /// Records the `failures`-th failure in a row: no attempt before `at` (Unix seconds,
    /// `wait` from now).
    pub(crate) async fn set_retry(&self, at: i64, failures: u32, wait: Duration) -> Result<(), String> {
        let text = format!("{at} {failures}");
        match &self.place {
            Place::Disk { directory, .. } => write(directory, "retry", &text),
            Place::Redis(_) => {
                // Kept a day past the retry, so that the count of failures doubles on.
                let ttl = wait + Duration::from_secs(86_400);
                self.redis(
                    redis::cmd("SET")
                        .arg(self.key("retry", &self.set))
                        .arg(text)
                        .arg("PX")
                        .arg(ttl.as_millis() as u64),
                )
                .await
            }
        }
    }

    pub(crate) async fn clear_retry(&self) -> Result<(), String> {
        match &self.place {
            Place::Disk { directory, .. } => match std::fs::remove_file(directory.join("retry")) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.to_string()),
                _ => Ok(()),
            },
            Place::Redis(_) => {
                self.redis(redis::cmd("DEL").arg(self.key("retry", &self.set)))
                    .await
            }
        }
    }

    fn key(&self, kind: &str, id: &str) -> String {
        let Place::Redis(redis) = &self.place else {
            unreachable!("keys are Redis's")
        };
        format!("{}:acme:{kind}:{id}", redis.prefix)
    }

    fn challenge_key(&self, challenge: &Challenge) -> String {
        match challenge {
            Challenge::Http(token) => self.key("http-01", token),
            Challenge::TlsAlpn(name) => self.key("tls-alpn-01", name),
        }
    }

    async fn connection(&self) -> Result<Connection, String> {
        let Place::Redis(redis) = &self.place else {
            unreachable!("connections are Redis's")
        };
        let mut held = redis.connection.lock().await;
        if let Some(connection) = held.as_ref() {
            return Ok(connection.clone());
        }
        let made = tokio::time::timeout(TIMEOUT, redis.source.connect())
            .await
            .map_err(|_| "Redis: no connection within 5 s".to_owned())?
            .map_err(|e| format!("Redis: {e}"))?;
        *held = Some(made.clone());
        Ok(made)
    }

    async fn redis<T: redis::FromRedisValue>(&self, command: &mut redis::Cmd) -> Result<T, String> {
        let mut connection = self.connection().await?;
        within(command.query_async(&mut connection)).await
    }
}

async fn within<T>(call: impl Future<Output = redis::RedisResult<T>>) -> Result<T, String> {
    tokio::time::timeout(TIMEOUT, call)
        .await
        .map_err(|_| "Redis: no answer within 5 s".to_owned())?
        .map_err(|e| format!("Redis: {e}"))
}

/// The first 16 hex digits of SHA-256 of `bytes`.
fn hex_digest(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(bytes);
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// A file's text, or `None` when it does not exist.
fn read(path: &Path) -> Result<Option<String>, String> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// Replaces `directory/name` with `text` whole (a new file renamed over it), readable by
/// floodgate's user alone; makes `directory` (mode 0700) when missing.
fn write(directory: &Path, name: &str, text: &str) -> Result<(), String> {
    use std::io::Write as _;
    use std::os::unix::fs::DirBuilderExt as _;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(directory)
        .map_err(|e| format!("{}: {e}", directory.display()))?;
    let path = directory.join(name);
    let mut file =
        tempfile::NamedTempFile::new_in(directory).map_err(|e| format!("{}: {e}", directory.display()))?;
    file.write_all(text.as_bytes())
        .and_then(|()| file.as_file().sync_all())
        .map_err(|e| format!("{}: {e}", path.display()))?;
    file.persist(&path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn disk_storage_keeps_what_it_is_given_privately() {
        use std::os::unix::fs::PermissionsExt as _;
        let root = tempfile::tempdir().unwrap();
        let storage = root.path().join("acme");
        let domains = ["b.example".to_owned(), "a.example".to_owned()];
        let disk = Storage::new("https://ca/dir", &domains, Some(&storage), None).unwrap();
        assert_eq!(disk.certificate().await.unwrap(), None);
        assert_eq!(disk.account().await.unwrap(), None);
        let certificate = StoredCertificate {
            chain: "CHAIN".to_owned(),
            key: "KEY".to_owned(),
        };
        disk.save_certificate(&certificate).await.unwrap();
        disk.save_account("{}").await.unwrap();
        disk.set_retry(100, 2, Duration::from_secs(60)).await.unwrap();
        // The same CA and names in another order: the same certificate.
        let again = Storage::new(
            "https://ca/dir",
            &["a.example".to_owned(), "b.example".to_owned()],
            Some(&storage),
            None,
        )
        .unwrap();
        assert_eq!(again.certificate().await.unwrap(), Some(certificate));
        assert_eq!(again.account().await.unwrap().as_deref(), Some("{}"));
        assert_eq!(again.retry().await.unwrap(), Some((100, 2)));
        again.clear_retry().await.unwrap();
        assert_eq!(again.retry().await.unwrap(), None);
        // Another CA: another account and certificate.
        let other = Storage::new("https://other/dir", &domains, Some(&storage), None).unwrap();
        assert_eq!(other.certificate().await.unwrap(), None);
        assert_eq!(other.account().await.unwrap(), None);
        let mode = |path: &Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&storage), 0o700);
        for entry in std::fs::read_dir(&storage).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                assert_eq!(mode(&path), 0o700, "{}", path.display());
                for file in std::fs::read_dir(&path).unwrap() {
                    assert_eq!(mode(&file.unwrap().path()), 0o600);
                }
            } else {
                assert_eq!(mode(&path), 0o600, "{}", path.display());
            }
        }
    }
}
