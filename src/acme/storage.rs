//! Where ACME state lives: on disk under `storage` without `[redis]`, in Redis with it, so
//! that every instance shares one account, one certificate and its key, the pending
//! challenges (any instance answers the CA) and the lock that lets one instance order at a
//! time. The account and the certificate have no TTL (the one exception to the rule that
//! every floodgate key has one); challenges, the lock and the retry time do.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use redis::Script;
use tokio::sync::Mutex;

use crate::config::RedisConfig;
use crate::limit::redis::StoreError;
use crate::limit::redis::connection::{Connection, Source};

/// How long one storage operation may take.
const TIMEOUT: Duration = Duration::from_secs(5);
/// How long the published challenges are kept after the last was published: longer than
/// any order takes (an instance that dies half way withdraws nothing).
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

impl Challenge {
    /// Its field in the set's hash of published challenges.
    fn field(&self) -> String {
        match self {
            Challenge::Http(token) => format!("http-01:{token}"),
            Challenge::TlsAlpn(name) => format!("tls-alpn-01:{name}"),
        }
    }

    fn of_field(field: &str) -> Option<Challenge> {
        match field.split_once(':')? {
            ("http-01", token) => Some(Challenge::Http(token.to_owned())),
            ("tls-alpn-01", name) => Some(Challenge::TlsAlpn(name.to_owned())),
            _ => None,
        }
    }
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
    take_lock: Script,
    let_go: Script,
}

impl InRedis {
    fn key(&self, kind: &str, id: &str) -> String {
        format!("{}:acme:{kind}:{id}", self.prefix)
    }

    async fn connection(&self) -> Result<Connection, String> {
        let mut held = self.connection.lock().await;
        if let Some(connection) = held.as_ref() {
            return Ok(connection.clone());
        }
        let made = tokio::time::timeout(TIMEOUT, self.source.connect())
            .await
            .map_err(|_| "Redis: no connection within 5 s".to_owned())?
            .map_err(|e| format!("Redis: {e}"))?;
        *held = Some(made.clone());
        Ok(made)
    }

    async fn query<T: redis::FromRedisValue>(&self, command: &mut redis::Cmd) -> Result<T, String> {
        let mut connection = self.connection().await?;
        self.within(command.query_async(&mut connection)).await
    }

    /// `call`'s answer within [`TIMEOUT`]. A failure drops the connection, so that the next
    /// operation connects anew (through sentinels: to the master they name after a
    /// failover).
    async fn within<T>(&self, call: impl Future<Output = redis::RedisResult<T>>) -> Result<T, String> {
        let answer = match tokio::time::timeout(TIMEOUT, call).await {
            Ok(Ok(answer)) => return Ok(answer),
            Ok(Err(error)) => format!("Redis: {error}"),
            Err(_) => "Redis: no answer within 5 s".to_owned(),
        };
        *self.connection.lock().await = None;
        Err(answer)
    }
}

/// What is kept of an account, beside the CA's directory.
#[derive(Clone, Copy)]
enum AccountPart {
    Credentials,
    Contact,
}

impl AccountPart {
    /// Its key's kind in Redis.
    fn kind(self) -> &'static str {
        match self {
            AccountPart::Credentials => "account",
            AccountPart::Contact => "account-contact",
        }
    }

    /// Its file on disk, for the account `id`.
    fn file(self, id: &str) -> String {
        match self {
            AccountPart::Credentials => format!("account-{id}.json"),
            AccountPart::Contact => format!("account-{id}.contact"),
        }
    }
}

const TAKE_LOCK_LUA: &str = include_str!("scripts/take_lock.lua");
const LET_GO_LUA: &str = include_str!("scripts/let_go.lua");

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
                take_lock: Script::new(TAKE_LOCK_LUA),
                let_go: Script::new(LET_GO_LUA),
            })),
            (None, disk) => {
                let root = disk
                    .expect("validated: storage is required without [redis]")
                    .to_path_buf();
                Place::Disk {
                    directory: root.join(format!("{}-{set}", sorted[0])),
                    root,
                }
            }
        };
        Ok(Storage { set, account, place })
    }

    /// Makes the storage directory (mode 0700) when on disk and missing, so that a place
    /// floodgate cannot write is reported at start rather than after an order.
    pub(crate) fn prepare(&self) -> Result<(), String> {
        match &self.place {
            Place::Disk { root, .. } => create_private(root),
            Place::Redis(_) => Ok(()),
        }
    }

    /// Whether other instances share this storage (and so the challenges and the lock).
    pub(crate) fn shared(&self) -> bool {
        matches!(self.place, Place::Redis(_))
    }

    /// Where it is, for logs.
    pub(crate) fn describe(&self) -> String {
        match &self.place {
            Place::Disk { directory, .. } => directory.display().to_string(),
            Place::Redis(db) => format!("Redis, under {}:acme:", db.prefix),
        }
    }

    /// The account's credentials (JSON), when one was made.
    pub(crate) async fn account(&self) -> Result<Option<String>, String> {
        self.account_part(AccountPart::Credentials).await
    }

    pub(crate) async fn save_account(&self, credentials: &str) -> Result<(), String> {
        self.save_account_part(AccountPart::Credentials, credentials)
            .await
    }

    /// The contacts the account last gave the CA, one a line, when recorded.
    pub(crate) async fn account_contact(&self) -> Result<Option<String>, String> {
        self.account_part(AccountPart::Contact).await
    }

    pub(crate) async fn save_account_contact(&self, contact: &str) -> Result<(), String> {
        self.save_account_part(AccountPart::Contact, contact).await
    }

    async fn account_part(&self, part: AccountPart) -> Result<Option<String>, String> {
        match &self.place {
            Place::Disk { root, .. } => read(root.join(part.file(&self.account))).await,
            Place::Redis(db) => {
                db.query(redis::cmd("GET").arg(db.key(part.kind(), &self.account)))
                    .await
            }
        }
    }

    async fn save_account_part(&self, part: AccountPart, text: &str) -> Result<(), String> {
        match &self.place {
            Place::Disk { root, .. } => write(root.clone(), part.file(&self.account), text.to_owned()).await,
            Place::Redis(db) => {
                db.query(
                    redis::cmd("SET")
                        .arg(db.key(part.kind(), &self.account))
                        .arg(text),
                )
                .await
            }
        }
    }

    /// The certificate last obtained, by any instance.
    pub(crate) async fn certificate(&self) -> Result<Option<StoredCertificate>, String> {
        match &self.place {
            Place::Disk { directory, .. } => {
                let chain = read(directory.join("certificate.pem")).await?;
                let key = read(directory.join("key.pem")).await?;
                Ok(chain
                    .zip(key)
                    .map(|(chain, key)| StoredCertificate { chain, key }))
            }
            Place::Redis(db) => {
                let fields: Vec<Option<String>> = db
                    .query(
                        redis::cmd("HMGET")
                            .arg(db.key("certificate", &self.set))
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
                write(directory.clone(), "key.pem".to_owned(), certificate.key.clone()).await?;
                write(
                    directory.clone(),
                    "certificate.pem".to_owned(),
                    certificate.chain.clone(),
                )
                .await
            }
            Place::Redis(db) => {
                db.query(
                    redis::cmd("HSET")
                        .arg(db.key("certificate", &self.set))
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
        let Place::Redis(db) = &self.place else {
            return Ok(());
        };
        let key = db.key("challenges", &self.set);
        let mut connection = db.connection().await?;
        db.within(
            redis::pipe()
                .atomic()
                .hset(&key, challenge.field(), key_authorization)
                .ignore()
                .pexpire(&key, CHALLENGE_TTL.as_millis() as i64)
                .ignore()
                .query_async::<()>(&mut connection),
        )
        .await
    }

    pub(crate) async fn withdraw(&self, challenge: &Challenge) -> Result<(), String> {
        let Place::Redis(db) = &self.place else {
            return Ok(());
        };
        db.query(
            redis::cmd("HDEL")
                .arg(db.key("challenges", &self.set))
                .arg(challenge.field()),
        )
        .await
    }

    /// Every challenge an instance published and has not withdrawn, in one read.
    pub(crate) async fn published(&self) -> Result<HashMap<Challenge, String>, String> {
        let Place::Redis(db) = &self.place else {
            return Ok(HashMap::new());
        };
        let fields: HashMap<String, String> = db
            .query(redis::cmd("HGETALL").arg(db.key("challenges", &self.set)))
            .await?;
        Ok(fields
            .into_iter()
            .filter_map(|(field, answer)| Some((Challenge::of_field(&field)?, answer)))
            .collect())
    }

    /// Takes (or extends) the lock that lets one instance order, for `lease`; false when
    /// another instance holds it. On disk there is one instance: always true.
    pub(crate) async fn lock(&self, holder: &str, lease: Duration) -> Result<bool, String> {
        let Place::Redis(db) = &self.place else {
            return Ok(true);
        };
        let mut invocation = db.take_lock.prepare_invoke();
        invocation
            .key(db.key("lock", &self.set))
            .arg(holder)
            .arg(lease.as_millis() as u64);
        let mut connection = db.connection().await?;
        let taken: u8 = db.within(invocation.invoke_async(&mut connection)).await?;
        Ok(taken == 1)
    }

    pub(crate) async fn unlock(&self, holder: &str) -> Result<(), String> {
        let Place::Redis(db) = &self.place else {
            return Ok(());
        };
        let mut invocation = db.let_go.prepare_invoke();
        invocation.key(db.key("lock", &self.set)).arg(holder);
        let mut connection = db.connection().await?;
        db.within(invocation.invoke_async::<u8>(&mut connection))
            .await
            .map(drop)
    }

    /// When the next attempt may be made after failures, and how many failed in a row.
    pub(crate) async fn retry(&self) -> Result<Option<(i64, u32)>, String> {
        let text = match &self.place {
            Place::Disk { directory, .. } => read(directory.join("retry")).await?,
            Place::Redis(db) => {
                db.query(redis::cmd("GET").arg(db.key("retry", &self.set)))
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
            Place::Disk { directory, .. } => write(directory.clone(), "retry".to_owned(), text).await,
            Place::Redis(db) => {
                // Kept a day past the retry, so that the count of failures doubles on.
                let ttl = wait.saturating_add(Duration::from_secs(86_400));
                db.query(
                    redis::cmd("SET")
                        .arg(db.key("retry", &self.set))
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
            Place::Disk { directory, .. } => match tokio::fs::remove_file(directory.join("retry")).await {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e.to_string()),
                _ => Ok(()),
            },
            Place::Redis(db) => db.query(redis::cmd("DEL").arg(db.key("retry", &self.set))).await,
        }
    }
}

/// The first 16 hex digits of SHA-256 of `bytes`.
fn hex_digest(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(bytes);
    digest[..8].iter().map(|b| format!("{b:02x}")).collect()
}

/// A file's text, or `None` when it does not exist.
async fn read(path: PathBuf) -> Result<Option<String>, String> {
    match tokio::fs::read_to_string(&path).await {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// Replaces `directory/name` with `text` whole (a new file renamed over it), readable by
/// floodgate's user alone; makes `directory` (mode 0700) when missing. Off the runtime's
/// threads: it waits for the disk.
async fn write(directory: PathBuf, name: String, text: String) -> Result<(), String> {
    tokio::task::spawn_blocking(move || {
        use std::io::Write as _;
        create_private(&directory)?;
        let path = directory.join(name);
        let mut file = tempfile::NamedTempFile::new_in(&directory)
            .map_err(|e| format!("{}: {e}", directory.display()))?;
        file.write_all(text.as_bytes())
            .and_then(|()| file.as_file().sync_all())
            .map_err(|e| format!("{}: {e}", path.display()))?;
        file.persist(&path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(())
    })
    .await
    .map_err(|e| e.to_string())?
}

/// Makes `directory` and its missing parents, mode 0700.
fn create_private(directory: &Path) -> Result<(), String> {
    use std::os::unix::fs::DirBuilderExt as _;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(directory)
        .map_err(|e| format!("{}: {e}", directory.display()))
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
