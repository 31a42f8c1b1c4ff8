//! Everything a request needs that a reload may replace, behind one `ArcSwap`: the
//! validated config, the route table and the runtime objects built from them (upstream
//! connection pools). A request loads it once and keeps that snapshot to the end.

use std::collections::HashMap;
use std::sync::Arc;

use crate::client_ip::TrustedProxies;
use crate::config::{Config, RespondConfig, RouteTarget};
use crate::proxy::UpstreamClient;
use crate::router::Router;

/// One loaded configuration, ready to serve.
pub struct GatewayState {
    pub config: Arc<Config>,
    pub router: Router,
    pub trusted_proxies: TrustedProxies,
    /// Per route (same order as the router's): where its requests go.
    pub targets: Vec<Target>,
}

/// A route's destination, with its runtime objects.
pub enum Target {
    Upstream(Arc<UpstreamClient>),
    Respond(RespondConfig),
}

impl GatewayState {
    pub fn new(config: Config) -> Self {
        let clients: HashMap<&str, Arc<UpstreamClient>> = config
            .upstreams
            .iter()
            .map(|(name, upstream)| (name.as_str(), Arc::new(UpstreamClient::new(upstream.clone()))))
            .collect();
        let targets = config
            .routes
            .iter()
            .map(|route| match &route.target {
                RouteTarget::Upstream(upstream) => Target::Upstream(clients[upstream.name.as_str()].clone()),
                RouteTarget::Respond(respond) => Target::Respond(respond.clone()),
            })
            .collect();
        let router = Router::new(config.routes.clone());
        let trusted_proxies = TrustedProxies::new(config.server.trusted_proxies.clone());
        GatewayState {
            config: Arc::new(config),
            router,
            trusted_proxies,
            targets,
        }
    }
}
