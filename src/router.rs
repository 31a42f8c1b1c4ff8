//! The route table: a pure lookup from (host, normalized path, method) to the first
//! matching route, in file order. No I/O, no allocation per lookup.

use http::Method;

use crate::config::{HostMatch, RouteConfig};

/// Routes in file order.
#[derive(Debug, Clone, Default)]
pub struct Router {
    routes: Vec<RouteConfig>,
}

impl Router {
    pub fn new(routes: Vec<RouteConfig>) -> Self {
        Router { routes }
    }

    /// The index of the first route matching `host` (already passed through
    /// [`normalize_host`](crate::host::normalize_host)), the normalized `path` and `method`.
    pub fn lookup(&self, host: Option<&str>, path: &str, method: &Method) -> Option<usize> {
        self.routes.iter().position(|route| {
            host_matches(&route.host, host)
                && route.path.matches(path)
                && method_matches(&route.methods, method)
        })
    }

    pub fn routes(&self) -> &[RouteConfig] {
        &self.routes
    }
}

fn host_matches(pattern: &Option<HostMatch>, host: Option<&str>) -> bool {
    match (pattern, host) {
        (None, _) => true,
        (Some(_), None) => false,
        (Some(HostMatch::Exact(name)), Some(host)) => name == host,
        (Some(HostMatch::Wildcard(suffix)), Some(host)) => {
            host.len() > suffix.len() && host.ends_with(suffix.as_str())
        }
    }
}

fn method_matches(methods: &Option<Vec<Method>>, method: &Method) -> bool {
    methods.as_ref().is_none_or(|list| list.contains(method))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::config::{PathMatch, RespondConfig, RouteTarget};

    fn route(
        name: &str,
        host: Option<HostMatch>,
        path: PathMatch,
        methods: Option<Vec<Method>>,
    ) -> RouteConfig {
        RouteConfig {
            name: Arc::from(name),
            host,
            path,
            methods,
            target: RouteTarget::Respond(RespondConfig {
                status: http::StatusCode::OK,
                body: bytes::Bytes::new(),
                content_type: http::HeaderValue::from_static("text/plain"),
                headers: Vec::new(),
            }),
            limits: Vec::new(),
            cost: 1,
            allow: None,
            deny: Vec::new(),
            strip_prefix: None,
            request_headers: Default::default(),
            response_headers: Default::default(),
            site: None,
            compress: false,
        }
    }

    fn table() -> Router {
        Router::new(vec![
            route(
                "exact-host",
                Some(HostMatch::Exact("api.example.com".into())),
                PathMatch::Prefix("/".into()),
                None,
            ),
            route(
                "wildcard",
                Some(HostMatch::Wildcard(".example.com".into())),
                PathMatch::Prefix("/w".into()),
                None,
            ),
            route(
                "health",
                None,
                PathMatch::Exact("/health".into()),
                Some(vec![Method::GET]),
            ),
            route(
                "api",
                None,
                PathMatch::Prefix("/api/".into()),
                Some(vec![Method::GET, Method::POST]),
            ),
            route(
                "fallback",
                None,
                PathMatch::Prefix("/".into()),
                Some(vec![Method::GET]),
            ),
        ])
    }

    fn lookup<'a>(router: &'a Router, host: Option<&str>, path: &str, method: Method) -> Option<&'a str> {
        router
            .lookup(host, path, &method)
            .map(|i| &*router.routes()[i].name)
    }

    #[test]
    fn first_match_in_file_order_wins() {
        let router = table();
        assert_eq!(
            lookup(&router, Some("api.example.com"), "/w", Method::GET),
            Some("exact-host")
        );
        assert_eq!(
            lookup(&router, Some("x.example.com"), "/w/1", Method::GET),
            Some("wildcard")
        );
        assert_eq!(
            lookup(&router, Some("x.example.com"), "/api/1", Method::GET),
            Some("api")
        );
    }

    #[test]
    fn wildcard_needs_a_subdomain() {
        let router = table();
        assert_eq!(
            lookup(&router, Some("a.b.example.com"), "/w", Method::GET),
            Some("wildcard")
        );
        assert_eq!(
            lookup(&router, Some("example.com"), "/w", Method::GET),
            Some("fallback")
        );
        assert_eq!(
            lookup(&router, Some("badexample.com"), "/w", Method::GET),
            Some("fallback")
        );
    }

    #[test]
    fn exact_path_and_methods() {
        let router = table();
        assert_eq!(lookup(&router, None, "/health", Method::GET), Some("health"));
        assert_eq!(lookup(&router, None, "/health/x", Method::GET), Some("fallback"));
        assert_eq!(lookup(&router, None, "/api/x", Method::POST), Some("api"));
        assert_eq!(lookup(&router, None, "/api", Method::GET), Some("fallback"));
        assert_eq!(lookup(&router, None, "/other", Method::DELETE), None);
    }
}
