//! Everything a request needs that a reload may replace, behind one `ArcSwap`: the
//! validated config, the route table and the runtime objects built from them (upstream
//! connection pools, per-route limits, the rate-limit store). A request loads it once and
//! keeps that snapshot to the end.

use std::collections::HashMap;
use std::sync::Arc;

use super::limits::RouteLimits;
use crate::acme::Acme;
use crate::client_ip::TrustedProxies;
use crate::config::{
    CombinedRules, Config, DEFAULT_PREFIX, KeyPart, RedisConfig, RespondConfig, RouteTarget, Site,
};
use crate::limit::redis::refusals::RefusalCache;
use crate::limit::redis::{RedisTarget, StoreError};
use crate::limit::store::{LimitStore, OnError, RedisSeries};
use crate::metrics::Metrics;
use crate::router::Router;
use crate::tls::Handshakes;
use crate::trace::Tracer;
use crate::upstream::Upstream;
use crate::upstream::places::ConnectionPlaces;

/// One loaded configuration, ready to serve.
pub(crate) struct GatewayState {
    pub(crate) config: Arc<Config>,
    pub(crate) router: Router,
    pub(crate) trusted_proxies: TrustedProxies,
    /// Per route (same order as the router's).
    pub(crate) routes: Vec<RouteRuntime>,
    pub(crate) store: LimitStore,
    pub(crate) key_prefix: String,
    pub(crate) on_error: OnError,
    /// The underscore spellings (`x_debug`) of the headers some limit keys on, some
    /// request rules set or remove, and of the request ID's: they never reach the upstream (CGI and PHP read
    /// `X_Debug` as `X-Debug`, so a client could otherwise plant or keep one).
    pub(crate) guarded_spellings: Vec<String>,
    /// Refusals remembered until they could pass (new with every configuration), in
    /// front of Redis only: the in-process store decides as fast as the cache answers.
    pub(crate) refusals: Option<RefusalCache>,
    /// The HTTPS listener's handshakes, with this configuration's certificates.
    pub(crate) tls: Option<Arc<Handshakes>>,
    /// `[server.tls.acme]`: kept across reloads that change neither it nor `[redis]`.
    pub(crate) acme: Option<Arc<Acme>>,
    /// `[tracing]`: kept across reloads that do not change it.
    pub(crate) tracer: Option<Arc<Tracer>>,
    /// The places of upstream connections, the same for every configuration.
    connection_places: Arc<ConnectionPlaces>,
}

impl GatewayState {
    fn upstream(&self, name: &str) -> Option<Arc<Upstream>> {
        self.routes.iter().find_map(|route| match &route.target {
            Target::Upstream(upstream) if upstream.config.name == name => Some(upstream.clone()),
            _ => None,
        })
    }
}

/// Whether two `[redis]` settings can share one store (the same server and deadline).
fn same_store(old: &Option<RedisConfig>, new: &Option<RedisConfig>) -> bool {
    match (old, new) {
        (None, None) => true,
        (Some(old), Some(new)) => old.target == new.target && old.timeout == new.timeout,
        _ => false,
    }
}

/// Whether an ACME manager can go on from `old` to `new`: the same `[redis]` (server and
/// prefix) keeps its account, certificate and lock where they are.
fn same_acme_store(old: &Config, new: &Config) -> bool {
    fn place(config: &Config) -> Option<(&RedisTarget, &str)> {
        config
            .redis
            .as_ref()
            .map(|redis| (&redis.target, redis.prefix.as_str()))
    }
    place(old) == place(new)
}

/// A route's destination and limits, with their runtime objects.
pub(crate) struct RouteRuntime {
    pub(crate) target: Target,
    pub(crate) limits: RouteLimits,
    /// The route's request rules with the server's, read as the headers go upstream.
    pub(crate) request_rules: Option<CombinedRules>,
    /// Its response rules with the server's, applied as an HTTP server's response head
    /// is read.
    pub(crate) response_rules: Option<Arc<CombinedRules>>,
}

/// Where a route's requests go.
pub(crate) enum Target {
    Upstream(Arc<Upstream>),
    Respond(RespondConfig),
    /// A site's files alone.
    Files(Site),
}

impl GatewayState {
    /// Builds the runtime for `config`, its upstream connections in `places`; must run
    /// inside the runtime (the Redis store connects in the background).
    pub(crate) fn new(
        config: Config,
        metrics: &Metrics,
        places: Arc<ConnectionPlaces>,
    ) -> Result<Self, StoreError> {
        GatewayState::build(config, places, None, metrics)
    }

    /// Builds the runtime for a reloaded `config`, keeping what did not change: the store
    /// (so in-process counters survive, and the Redis connection too) and the connection
    /// pools of unchanged upstreams.
    pub(crate) fn rebuild(
        config: Config,
        previous: &GatewayState,
        metrics: &Metrics,
    ) -> Result<Self, StoreError> {
        GatewayState::build(
            config,
            previous.connection_places.clone(),
            Some(previous),
            metrics,
        )
    }

    fn build(
        config: Config,
        connection_places: Arc<ConnectionPlaces>,
        previous: Option<&GatewayState>,
        metrics: &Metrics,
    ) -> Result<Self, StoreError> {
        // An upstream whose definition did not change is kept: its connections, health,
        // requests in flight and queue.
        let upstreams: HashMap<&str, Arc<Upstream>> = config
            .upstreams
            .iter()
            .map(|(name, config)| {
                let previous = previous.and_then(|p| p.upstream(name));
                let upstream = match previous {
                    Some(kept) if *kept.config == **config => kept,
                    replaced => Arc::new(Upstream::new(
                        config.clone(),
                        metrics,
                        &connection_places,
                        replaced.as_deref(),
                    )),
                };
                (name.as_str(), upstream)
            })
            .collect();
        // Each limit's largest route cost: a key with less left is refused by that route.
        let mut largest_cost: HashMap<&str, u64> = HashMap::new();
        for route in &config.routes {
            for limit in &route.limits {
                let largest = largest_cost.entry(&limit.name).or_default();
                *largest = (*largest).max(route.cost);
            }
        }
        let routes = config
            .routes
            .iter()
            .map(|route| RouteRuntime {
                target: match &route.target {
                    RouteTarget::Upstream(upstream) => {
                        Target::Upstream(upstreams[upstream.name.as_str()].clone())
                    }
                    RouteTarget::Respond(respond) => Target::Respond(respond.clone()),
                    RouteTarget::Files(site) => Target::Files(site.clone()),
                },
                limits: RouteLimits::new(
                    route.limits.clone(),
                    route.cost,
                    route
                        .limits
                        .iter()
                        .map(|limit| largest_cost[&*limit.name])
                        .collect(),
                ),
                request_rules: CombinedRules::of(&config.server.request_headers, &route.request_headers),
                response_rules: CombinedRules::of(&config.server.response_headers, &route.response_headers)
                    .map(Arc::new),
            })
            .collect();
        let key_headers = config
            .limits
            .values()
            .flat_map(|limit| &limit.key)
            .filter_map(|part| match part {
                KeyPart::Header(name) => Some(name),
                _ => None,
            });
        let rule_headers = config
            .routes
            .iter()
            .map(|route| &route.request_headers)
            .chain([&config.server.request_headers])
            .flat_map(|rules| rules.set.iter().map(|(name, _)| name).chain(&rules.remove));
        let mut guarded_spellings: Vec<String> = key_headers
            .chain(rule_headers)
            .chain(&config.server.request_id)
            .map(|name| name.as_str().replace('-', "_"))
            .collect();
        guarded_spellings.sort();
        guarded_spellings.dedup();
        let store = match previous {
            Some(previous) if same_store(&previous.config.redis, &config.redis) => previous.store.clone(),
            _ => match &config.redis {
                None => LimitStore::memory(metrics.keys_not_kept("memory")),
                Some(redis) => LimitStore::redis(
                    &redis.target,
                    redis.timeout,
                    &redis.prefix,
                    RedisSeries {
                        local_not_kept: metrics.keys_not_kept("local"),
                        errors: metrics.store_errors("redis"),
                        breaker_open: metrics.breaker_open("redis"),
                    },
                )?,
            },
        };
        let (key_prefix, on_error) = match &config.redis {
            Some(redis) => (redis.prefix.clone(), redis.on_error),
            None => (DEFAULT_PREFIX.to_owned(), OnError::Allow),
        };
        if let Some(previous) = previous {
            for (name, upstream) in &previous.config.upstreams {
                for server in &upstream.servers {
                    let kept = config
                        .upstreams
                        .get(name)
                        .is_some_and(|u| u.servers.iter().any(|s| s.address == server.address));
                    if !kept {
                        metrics.forget_upstream_server(name, &server.address.label());
                    }
                }
            }
        }
        let refusals = store.in_redis().then(RefusalCache::default);
        let acme = match config.server.tls.as_ref().and_then(|tls| tls.acme.as_ref()) {
            None => None,
            Some(acme) => {
                let previous =
                    previous.and_then(|previous| Some((previous.acme.as_ref()?, &previous.config)));
                Some(match previous {
                    Some((kept, old)) if kept.config() == acme && same_acme_store(old, &config) => {
                        kept.clone()
                    }
                    _ => Acme::start(
                        acme,
                        config.redis.as_ref(),
                        metrics,
                        previous.map(|(acme, _)| &**acme),
                    )?,
                })
            }
        };
        // Every series replaced, none left when a reload removed [server.tls].
        let expiry: Vec<(String, i64)> = (config.server.tls.iter())
            .flat_map(|tls| &tls.certificates)
            .map(|c| (c.label(), c.not_after))
            .collect();
        metrics.set_certificate_expiry(&expiry);
        let tls = config.server.tls.as_ref().map(|tls| {
            // After the files': the ACME certificate, served first for its names.
            if let Some(acme) = &acme {
                acme.publish_expiry();
            }
            Arc::new(Handshakes::new(tls, acme.clone()))
        });
        let tracer = config.tracing.as_ref().map(|tracing| {
            previous
                .and_then(|previous| previous.tracer.clone())
                .filter(|kept| kept.config == *tracing)
                .unwrap_or_else(|| Arc::new(Tracer::start(tracing, metrics.spans_dropped())))
        });
        Ok(GatewayState {
            router: Router::new(config.routes.clone()),
            trusted_proxies: TrustedProxies::new(config.server.trusted_proxies.clone()),
            config: Arc::new(config),
            routes,
            store,
            key_prefix,
            on_error,
            guarded_spellings,
            refusals,
            tls,
            acme,
            tracer,
            connection_places,
        })
    }
}
