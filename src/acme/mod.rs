//! Automatic HTTPS (docs/operations.md#https): one certificate for `[server.tls.acme]`'s
//! names, obtained from an ACME CA (RFC 8555) and renewed before it expires, served from
//! the next handshake on, without a restart.
//!
//! Each gateway runs one manager task per `[server.tls.acme]` table. Every few seconds it
//! picks up what storage holds (another instance may have stored a newer certificate),
//! and when the certificate is due (none yet, two thirds of its life gone, or inside the
//! CA's ARI window) and no failure asks to wait, it takes the storage's lock and orders.
//! Challenges are answered by whichever instance the CA reaches: http-01 on the plain
//! listener before routing ([`Acme::http_answer`]), tls-alpn-01 on the TLS listener
//! ([`Acme::alpn_answer`]).

mod challenge;
mod client;
mod order;
mod schedule;
mod storage;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use arc_swap::ArcSwapOption;
use bytes::Bytes;
use instant_acme::{Account, AccountCredentials, CertificateIdentifier, ExternalAccountKey, NewAccount};
use prometheus_client::metrics::counter::Counter;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;

pub(crate) use challenge::http_token;
use challenge::{Challenges, alpn_certificate};
use client::CaClient;
use storage::{Challenge, Storage, StoredCertificate};

use crate::config::{AcmeConfig, RedisConfig};
use crate::limit::redis::StoreError;
use crate::logging::LogThrottle;
use crate::metrics::{CertificateExpiry, Metrics};
use crate::outbound::OneShot;

/// How often an instance sharing storage looks for a certificate another one stored.
const SHARED_POLL: Duration = Duration::from_secs(5);
/// How often an instance alone with its storage looks at it again.
const DISK_POLL: Duration = Duration::from_secs(60);
/// The ordering lock's lease; extended while the order runs.
const LEASE: Duration = Duration::from_secs(60);
/// One attempt at most (two orders' validations and the issuance included).
const ATTEMPT: Duration = Duration::from_secs(600);
/// How long the CA's renewal information may take.
const ARI_TIMEOUT: Duration = Duration::from_secs(60);

/// The ACME certificate of one configuration's `[server.tls.acme]`, kept across reloads
/// that do not change the table. Dropping it stops its manager.
pub(crate) struct Acme {
    shared: Arc<Shared>,
    manager: tokio::task::JoinHandle<()>,
}

/// A certificate in service.
#[derive(Clone)]
pub(crate) struct Served {
    pub(crate) key: Arc<CertifiedKey>,
    /// Its DNS names, lower case.
    pub(crate) names: Vec<String>,
    pub(crate) not_after: i64,
    not_before: i64,
    stored: StoredCertificate,
    /// Obtained for the previous configuration's names: served until this one's arrives.
    inherited: bool,
}

struct Shared {
    config: AcmeConfig,
    storage: Storage,
    challenges: Challenges,
    client: CaClient,
    served: ArcSwapOption<Served>,
    /// When the served certificate is due for renewal (Unix seconds).
    renew_at: AtomicI64,
    /// No attempt before this (Unix seconds): the backoff after a failure, a pause after
    /// a success; kept here as well as in storage, which may be what fails.
    not_before: AtomicI64,
    /// The served certificate could not be stored yet.
    unsaved: AtomicBool,
    /// Storage has been looked at once (a stored certificate, if any, is in service).
    looked: AtomicBool,
    /// When to ask the CA's ARI next (Unix seconds; `i64::MAX`: the CA has none).
    ask_ari_at: AtomicI64,
    orders_ok: Counter,
    orders_failed: Counter,
    expiry: CertificateExpiry,
    /// The lock's holder name: this manager's.
    holder: String,
    storage_warnings: LogThrottle,
}

impl Acme {
    /// Starts managing `config`'s certificate, keeping it in Redis with `redis`, serving
    /// `previous` (the certificate of the configuration this one replaces) until its own
    /// is there. Must run inside the runtime.
    pub(crate) fn start(
        config: &AcmeConfig,
        redis: Option<&RedisConfig>,
        metrics: &Metrics,
        previous: Option<&Acme>,
    ) -> Result<Arc<Acme>, StoreError> {
        let storage = Storage::new(
            &config.directory,
            &config.domains,
            config.storage.as_deref(),
            redis,
        )?;
        if let Err(error) = storage.prepare() {
            tracing::warn!(%error, "ACME: cannot make the storage directory; certificates obtained will not be kept");
        }
        let client = match &config.ca {
            Some(roots) => {
                // Each was checked to be a usable root when the configuration was loaded.
                let mut store = rustls::RootCertStore::empty();
                store.add_parsable_certificates(roots.iter().cloned());
                OneShot::new(store)
            }
            None => OneShot::with_native_roots(),
        };
        tracing::info!(names = ?config.domains, directory = %config.directory, storage = %storage.describe(), "ACME: managing a certificate");
        let inherited = previous.and_then(Acme::served).map(|served| {
            Arc::new(Served {
                inherited: true,
                ..Served::clone(&served)
            })
        });
        let shared = Arc::new(Shared {
            config: config.clone(),
            storage,
            challenges: Challenges::new(),
            client: CaClient::new(client),
            served: ArcSwapOption::new(inherited),
            renew_at: AtomicI64::new(i64::MIN),
            not_before: AtomicI64::new(i64::MIN),
            unsaved: AtomicBool::new(false),
            looked: AtomicBool::new(false),
            ask_ari_at: AtomicI64::new(i64::MIN),
            orders_ok: metrics.acme_orders("ok"),
            orders_failed: metrics.acme_orders("error"),
            expiry: metrics.certificate_expiry(),
            holder: format!("{:016x}", fastrand::u64(..)),
            storage_warnings: LogThrottle::default(),
        });
        let manager = tokio::spawn(manage(shared.clone()));
        Ok(Arc::new(Acme { shared, manager }))
    }

    /// Waits until the stored certificate, if there is one, is in service, at most
    /// `limit` (so that a starting instance serves it from its first handshake).
    pub(crate) async fn wait_stored(&self, limit: Duration) {
        let deadline = tokio::time::Instant::now() + limit;
        while !self.shared.looked.load(Ordering::Acquire) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    pub(crate) fn config(&self) -> &AcmeConfig {
        &self.shared.config
    }

    /// Publishes the served certificate's expiry (after a reload replaced the series).
    pub(crate) fn publish_expiry(&self) {
        self.shared.publish_expiry();
    }

    /// The certificate in service, once there is one.
    pub(crate) fn served(&self) -> Option<Arc<Served>> {
        self.shared.served.load_full()
    }

    /// The key authorization answering http-01 `token` for `host`, published by any
    /// instance; `None` when `host` is not one of the names (the request is then routed
    /// as any other, to an app that may answer its own challenges).
    pub(crate) async fn http_answer(&self, host: &str, token: &str) -> Option<Option<Bytes>> {
        if !self.holds(host) {
            return None;
        }
        let challenge = Challenge::Http(token.to_owned());
        Some(
            self.shared
                .challenges
                .answer(&self.shared.storage, &challenge)
                .await
                .map(Bytes::from),
        )
    }

    /// The certificate answering tls-alpn-01 for `name` (lower case), when a challenge for
    /// it is pending on any instance.
    pub(crate) async fn alpn_answer(&self, name: &str) -> Option<Arc<CertifiedKey>> {
        if !self.holds(name) {
            return None;
        }
        let challenge = Challenge::TlsAlpn(name.to_owned());
        let key_authorization = self
            .shared
            .challenges
            .answer(&self.shared.storage, &challenge)
            .await?;
        alpn_certificate(name, &key_authorization)
            .inspect_err(|error| tracing::warn!(%error, "cannot make the tls-alpn-01 certificate"))
            .ok()
    }

    /// Whether `name` (lower case) is one of the names.
    fn holds(&self, name: &str) -> bool {
        self.shared.config.domains.iter().any(|domain| domain == name)
    }
}

impl std::fmt::Debug for Acme {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Acme")
            .field("domains", &self.shared.config.domains)
            .finish()
    }
}

impl Drop for Acme {
    fn drop(&mut self) {
        self.manager.abort();
    }
}

async fn manage(shared: Arc<Shared>) {
    shared.update_stored_account().await;
    loop {
        let wait = shared.step().await;
        tokio::time::sleep(wait).await;
    }
}

impl Shared {
    /// One look at the certificate: picks up a stored one, orders when due; returns how
    /// long to wait before the next look.
    async fn step(&self) -> Duration {
        self.pick_up_stored().await;
        self.looked.store(true, Ordering::Release);
        self.save_unsaved().await;
        if tokio::time::timeout(ARI_TIMEOUT, self.ask_ari()).await.is_err() {
            tracing::debug!("ACME: the CA's renewal information took too long; asking again in an hour");
            self.ask_ari_at.store(unix_now() + 3600, Ordering::Relaxed);
        }
        let now = unix_now();
        let due = self
            .renew_at
            .load(Ordering::Relaxed)
            .max(self.not_before.load(Ordering::Relaxed));
        if due > now {
            return self.poll(due - now);
        }
        match self.storage.retry().await {
            Ok(Some((at, _))) if at > now => return self.poll(at - now),
            Ok(_) => {}
            Err(error) => {
                self.warn_storage(&error);
                return self.poll(i64::MAX);
            }
        }
        match self.storage.lock(&self.holder, LEASE).await {
            Ok(true) => {}
            // Another instance is ordering: its certificate will be picked up.
            Ok(false) => return self.poll(i64::MAX),
            Err(error) => {
                self.warn_storage(&error);
                return self.poll(i64::MAX);
            }
        }
        // Another instance may have stored one since the first look.
        self.pick_up_stored().await;
        let wait = if self.renew_at.load(Ordering::Relaxed) <= unix_now() {
            let result = self.attempt_holding_the_lock().await;
            self.record(result).await
        } else {
            Duration::ZERO
        };
        if let Err(error) = self.storage.unlock(&self.holder).await {
            tracing::debug!(%error, "ACME: the ordering lock is left to expire");
        }
        wait
    }

    /// How long to wait for something `seconds` away, looking at storage meanwhile.
    fn poll(&self, seconds: i64) -> Duration {
        let most = if self.storage.shared() {
            SHARED_POLL
        } else {
            DISK_POLL
        };
        Duration::from_secs(seconds.max(1) as u64).min(most)
    }

    /// Serves the stored certificate when it is valid and newer than the one served (or
    /// that one was the previous configuration's).
    async fn pick_up_stored(&self) {
        let stored = match self.storage.certificate().await {
            Ok(Some(stored)) => stored,
            Ok(None) => return,
            Err(error) => return self.warn_storage(&error),
        };
        let current = self.served.load_full();
        // Served already, and as this configuration's (one inherited from the previous
        // configuration is installed again, which sets when it is renewed).
        if current
            .as_ref()
            .is_some_and(|served| served.stored == stored && !served.inherited)
        {
            return;
        }
        match served(stored) {
            Ok(stored) if stored.not_after <= unix_now() => {}
            Ok(stored) => {
                let newer = current
                    .as_ref()
                    .is_none_or(|served| served.inherited || stored.not_after > served.not_after);
                if newer {
                    self.install(stored);
                }
            }
            Err(error) => {
                tracing::warn!(storage = %self.storage.describe(), %error, "ACME: the stored certificate cannot be used")
            }
        }
    }

    /// Stores the served certificate when that failed when it was obtained.
    async fn save_unsaved(&self) {
        if !self.unsaved.load(Ordering::Relaxed) {
            return;
        }
        let Some(served) = self.served.load_full() else {
            return;
        };
        match self.storage.save_certificate(&served.stored).await {
            Ok(()) => self.unsaved.store(false, Ordering::Relaxed),
            Err(error) => self.warn_storage(&error),
        }
    }

    fn install(&self, served: Served) {
        tracing::info!(names = ?served.names, not_after = served.not_after, "ACME: serving a new certificate");
        self.renew_at.store(
            schedule::two_thirds(served.not_before, served.not_after),
            Ordering::Relaxed,
        );
        self.ask_ari_at.store(i64::MIN, Ordering::Relaxed);
        // Served first, then published: a reload publishing meanwhile reads what is served.
        self.served.store(Some(Arc::new(served)));
        self.publish_expiry();
    }

    /// Publishes the served certificate's expiry, if there is one.
    fn publish_expiry(&self) {
        if let Some(served) = self.served.load().as_ref() {
            self.expiry.set(&self.config.domains[0], served.not_after);
        }
    }

    /// Asks the CA's renewal information (RFC 9773) when it is time: the renewal moves
    /// into the CA's window when that comes before two thirds of the lifetime.
    async fn ask_ari(&self) {
        let now = unix_now();
        if self.ask_ari_at.load(Ordering::Relaxed) > now {
            return;
        }
        let Some(served) = self.served.load_full().filter(|served| !served.inherited) else {
            return;
        };
        let Ok(Some(credentials)) = self.storage.account().await else {
            // Without an account yet, this instance has not ordered: ask later.
            self.ask_ari_at.store(now + 3600, Ordering::Relaxed);
            return;
        };
        let asked = async {
            let account = self.account_from(&credentials).await?;
            let identifier = CertificateIdentifier::try_from(&served.key.cert[0])?;
            Ok(account.renewal_info(&identifier).await)
        };
        match asked.await.and_then(|answer| match answer {
            Err(instant_acme::Error::Unsupported(_)) => Ok(None),
            answer => answer.map(Some).map_err(|e| e.to_string()),
        }) {
            Ok(None) => {
                self.ask_ari_at.store(i64::MAX, Ordering::Relaxed);
            }
            Ok(Some((info, retry_after))) => {
                let window = info.suggested_window;
                let pick = schedule::within_window(
                    window.start.unix_timestamp(),
                    window.end.unix_timestamp(),
                    now,
                    fastrand::f64(),
                );
                let two_thirds = schedule::two_thirds(served.not_before, served.not_after);
                self.renew_at.store(pick.min(two_thirds), Ordering::Relaxed);
                let next = retry_after.clamp(Duration::from_secs(60), Duration::from_secs(86_400));
                self.ask_ari_at
                    .store(now + next.as_secs() as i64, Ordering::Relaxed);
            }
            Err(error) => {
                tracing::debug!(%error, "ACME: renewal information unavailable; asking again in an hour");
                self.ask_ari_at.store(now + 3600, Ordering::Relaxed);
            }
        }
    }

    /// An attempt, while keeping the lock's lease; abandoned if another instance took
    /// the lock meanwhile (its lease ran out), so that two never order at once for long.
    async fn attempt_holding_the_lock(&self) -> Result<Served, String> {
        let keep_lease = async {
            loop {
                tokio::time::sleep(LEASE / 3).await;
                match self.storage.lock(&self.holder, LEASE).await {
                    Ok(true) => {}
                    Ok(false) => return,
                    Err(error) => self.warn_storage(&error),
                }
            }
        };
        tokio::select! {
            result = tokio::time::timeout(ATTEMPT, self.attempt()) => {
                result.unwrap_or_else(|_| Err(format!("not done within {} s", ATTEMPT.as_secs())))
            }
            () = keep_lease => Err("another instance took the ordering lock".to_owned()),
        }
    }

    async fn attempt(&self) -> Result<Served, String> {
        let account = self.account().await?;
        let domains = &self.config.domains;
        let stored = match order::obtain(&account, domains, &self.challenges, &self.storage).await {
            Err(order::Failure::UnknownAccount(detail)) => {
                tracing::warn!(%detail, "ACME: the CA does not know the stored account; making a new one");
                let account = self.new_account().await?;
                order::obtain(&account, domains, &self.challenges, &self.storage).await
            }
            obtained => obtained,
        }?;
        let served = served(stored)?;
        // Served even when it cannot be stored now: storing is tried again at every look.
        if let Err(error) = self.storage.save_certificate(&served.stored).await {
            self.warn_storage(&error);
            self.unsaved.store(true, Ordering::Relaxed);
        }
        Ok(served)
    }

    /// Counts and logs an attempt, serves what it obtained, and sets when the next one may
    /// be made; returns how long to wait before the next look.
    async fn record(&self, result: Result<Served, String>) -> Duration {
        let now = unix_now();
        match result {
            Ok(served) => {
                if let Err(error) = self.storage.clear_retry().await {
                    self.warn_storage(&error);
                }
                // A certificate due at once (a clock far off, a short-lived profile) is not
                // ordered again straight away.
                let pause = ((served.not_after - served.not_before) / 3)
                    .clamp(1, schedule::LONGEST_RETRY.as_secs() as i64);
                self.not_before.store(now + pause, Ordering::Relaxed);
                self.orders_ok.inc();
                self.install(served);
                Duration::ZERO
            }
            Err(error) => {
                let failures = match self.storage.retry().await {
                    Ok(retry) => retry.map_or(0, |(_, failures)| failures) + 1,
                    Err(_) => 1,
                };
                let wait = schedule::retry_delay(failures, self.client.take_retry_after());
                tracing::warn!(names = ?self.config.domains, %error, failures, retry_in = ?wait, "ACME: could not obtain a certificate; the current one stays in service");
                let at = now.saturating_add(wait.as_secs() as i64);
                self.not_before.store(at, Ordering::Relaxed);
                if let Err(error) = self.storage.set_retry(at, failures, wait).await {
                    self.warn_storage(&error);
                }
                self.orders_failed.inc();
                wait.min(self.poll(i64::MAX))
            }
        }
    }

    /// The stored account, or a new one (stored).
    async fn account(&self) -> Result<Account, String> {
        match self.storage.account().await? {
            Some(credentials) => {
                let account = self.account_from(&credentials).await?;
                if self.contact_outdated().await {
                    self.update_contact(&account).await;
                }
                Ok(account)
            }
            None => self.new_account().await,
        }
    }

    /// At start: a stored account is given the configured contacts if they changed (a
    /// reload that edits only `contact` orders nothing); with the CA out of reach, the
    /// next order does it.
    async fn update_stored_account(&self) {
        if !self.contact_outdated().await {
            return;
        }
        let Ok(Some(credentials)) = self.storage.account().await else {
            return;
        };
        match self.account_from(&credentials).await {
            Ok(account) => self.update_contact(&account).await,
            Err(error) => {
                tracing::debug!(%error, "ACME: the account's contact will be updated at the next order")
            }
        }
    }

    /// The configured contacts as storage records them, one a line.
    fn contact_record(&self) -> String {
        self.config.contact.join("\n")
    }

    /// Whether the configured contacts are not those the account last gave the CA (not
    /// when storage cannot tell: that is logged).
    async fn contact_outdated(&self) -> bool {
        match self.storage.account_contact().await {
            Ok(given) => given.as_deref() != Some(self.contact_record().as_str()),
            Err(error) => {
                self.warn_storage(&error);
                false
            }
        }
    }

    /// Gives the CA the configured contacts (the expiry and incident mail goes there),
    /// and records them; a failure is logged and the account used as it is.
    async fn update_contact(&self, account: &Account) {
        let contact: Vec<&str> = self.config.contact.iter().map(String::as_str).collect();
        match account.update_contacts(&contact).await {
            Ok(()) => {
                tracing::info!(contact = ?self.config.contact, "ACME: the account's contact updated");
                if let Err(error) = self.storage.save_account_contact(&self.contact_record()).await {
                    self.warn_storage(&error);
                }
            }
            Err(error) => {
                tracing::warn!(%error, "ACME: the CA refused the account's new contact; it keeps the old one")
            }
        }
    }

    /// A new account, stored in place of any other.
    async fn new_account(&self) -> Result<Account, String> {
        let contact: Vec<&str> = self.config.contact.iter().map(String::as_str).collect();
        let binding = self
            .config
            .eab
            .as_ref()
            .map(|eab| ExternalAccountKey::new(eab.kid.clone(), &eab.hmac_key));
        let (account, credentials) = Account::builder_with_http(Box::new(self.client.clone()))
            .create(
                &NewAccount {
                    contact: &contact,
                    terms_of_service_agreed: true,
                    only_return_existing: false,
                },
                self.config.directory.clone(),
                binding.as_ref(),
            )
            .await
            .map_err(|e| format!("new account: {e}"))?;
        let credentials = serde_json::to_string(&credentials).map_err(|e| e.to_string())?;
        self.storage.save_account(&credentials).await?;
        if let Err(error) = self.storage.save_account_contact(&self.contact_record()).await {
            self.warn_storage(&error);
        }
        Ok(account)
    }

    async fn account_from(&self, credentials: &str) -> Result<Account, String> {
        let credentials: AccountCredentials =
            serde_json::from_str(credentials).map_err(|e| format!("the stored account: {e}"))?;
        Account::builder_with_http(Box::new(self.client.clone()))
            .from_credentials(credentials)
            .await
            .map_err(|e| format!("the CA's directory: {e}"))
    }

    fn warn_storage(&self, error: &str) {
        if self.storage_warnings.ready() {
            tracing::warn!(storage = %self.storage.describe(), %error, "ACME: storage failed (logged once a minute at most)");
        }
    }
}

/// `stored` ready to serve: the chain and key read and checked to belong together.
fn served(stored: StoredCertificate) -> Result<Served, String> {
    let chain = CertificateDer::pem_slice_iter(stored.chain.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("the chain: {e}"))?;
    let leaf = chain.first().ok_or("the chain holds no certificate")?;
    let facts = crate::config::leaf_facts(leaf)?;
    let key = PrivateKeyDer::from_pem_slice(stored.key.as_bytes()).map_err(|e| format!("the key: {e}"))?;
    let key = crate::config::certified_key(chain, key).map_err(|e| format!("the key: {e:?}"))?;
    Ok(Served {
        key: Arc::new(key),
        names: facts.names,
        not_before: facts.not_before,
        not_after: facts.not_after,
        stored,
        inherited: false,
    })
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}
