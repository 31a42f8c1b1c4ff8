//! What a valid configuration may still get wrong, for `floodgate check` and the log at
//! load: certificates past their notAfter, login protection that PHP can reach around (a
//! route restricted to some methods, or an exact path a front controller also answers
//! under other spellings), a PHP-FPM pool floodgate does not cap, a PHP-FPM site without a
//! bound on request bodies (which it spools to disk), a PHP-FPM check of a script
//! PHP-FPM cannot find, and a lock-out shorter than its limit's window.

use std::path::Path;
use std::time::Duration;

use super::{Config, PathMatch, RouteConfig, RouteTarget, UpstreamConfig};
use crate::limit::Algorithm;

/// Words in a route's name or path that make it look like a login.
const LOGIN_WORDS: [&str; 6] = ["login", "signin", "sign-in", "logon", "auth", "password"];

pub(super) fn warnings(config: &Config) -> Vec<String> {
    let mut warnings = expired_certificates(config);
    warnings.extend(
        config
            .upstreams
            .values()
            .filter(|upstream| upstream.fastcgi.is_some() && upstream.max_requests == 0)
            .map(|upstream| {
                format!(
                    "upstreams.{}: a fastcgi:// upstream without max_requests; set it to PHP-FPM's \
                     pm.max_children, so that requests wait in floodgate's queue rather than \
                     PHP-FPM's backlog",
                    upstream.name
                )
            }),
    );
    let reads_bodies_whole =
        |upstream: &UpstreamConfig| upstream.fastcgi.is_some() || upstream.max_requests > 0;
    if config.server.max_body.is_none() && config.upstreams.values().any(|u| reads_bodies_whole(u)) {
        warnings.push(
            "server.max_body: unlimited, while a request body for PHP-FPM or for an upstream \
             with max_requests is read whole (past 64 KB to a temporary file) before it is \
             sent: a client can fill the disk; set it (nginx's client_max_body_size is 1m \
             unless set)"
                .to_owned(),
        );
    }
    warnings.extend(php_checks_outside_php_root(config));
    warnings.extend(lockouts_shorter_than_their_window(config));
    for (i, route) in config.routes.iter().enumerate() {
        if guards_a_login(route) {
            warnings.extend(login_reached_around(&config.routes, i));
        }
    }
    warnings
}

/// A window limit whose `lockout` ends before its window: a client that waits the lock-out
/// out, as its `Retry-After` says, is refused by the window again, and that refusal starts
/// another lock-out.
fn lockouts_shorter_than_their_window(config: &Config) -> Vec<String> {
    config
        .limits
        .values()
        .filter_map(|limit| {
            let rate = limit.rate()?;
            let (Algorithm::FixedWindow { window, .. } | Algorithm::SlidingWindow { window, .. }) =
                rate.algorithm
            else {
                return None;
            };
            let window = Duration::from_micros(window);
            let lockout = rate.lockout.filter(|lockout| *lockout < window)?;
            Some(format!(
                "limits.{}.lockout: {} is shorter than its window ({}): a client that waits it out, as \
                 Retry-After tells it to, is refused by the window again and locked out again; \
                 make lockout at least the window",
                limit.name,
                humantime::format_duration(lockout),
                humantime::format_duration(window),
            ))
        })
        .collect()
}

/// An active check of a FastCGI upstream asking for a script that the `php_root` of no
/// route using the upstream holds: its `path` is the script's file as PHP-FPM sees it, so
/// `/health.php` alone is answered `404` and takes every server out of rotation.
fn php_checks_outside_php_root(config: &Config) -> Vec<String> {
    config
        .upstreams
        .values()
        .filter(|upstream| upstream.fastcgi.is_some())
        .filter_map(|upstream| {
            let path = upstream.health_check.as_ref()?.path.path();
            let roots: Vec<&str> = config
                .routes
                .iter()
                .filter(|route| {
                    matches!(&route.target, RouteTarget::Upstream(used) if used.name == upstream.name)
                })
                .filter_map(|route| Some(route.site.as_ref()?.php.as_ref()?.root.as_str()))
                .collect();
            let held = roots.iter().any(|root| Path::new(path).starts_with(root));
            if !path.ends_with(".php") || roots.is_empty() || held {
                return None;
            }
            Some(format!(
                "upstreams.{}.health_check.path: \"{path}\" is sent to PHP-FPM as the script's file \
                 (SCRIPT_FILENAME), and no php_root of the routes using the upstream holds it: \
                 PHP-FPM would answer 404 and every server would be taken out; did you mean \"{}{path}\"?",
                upstream.name,
                roots[0].trim_end_matches('/')
            ))
        })
        .collect()
}

fn expired_certificates(config: &Config) -> Vec<String> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    config
        .server
        .tls
        .iter()
        .flat_map(|tls| tls.certificates.iter().enumerate())
        .filter(|(_, c)| c.not_after < now)
        .map(|(i, c)| {
            format!(
                "server.tls.certificates[{i}].cert: {}: the certificate has expired",
                c.cert_path.display()
            )
        })
        .collect()
}

/// A route forwarding to an app with a failure-counting limit, or a login-like name or
/// path and a limit.
fn guards_a_login(route: &RouteConfig) -> bool {
    if !matches!(route.target, RouteTarget::Upstream(_)) || route.limits.is_empty() {
        return false;
    }
    let login_like = [&*route.name, route.path.as_str()].iter().any(|text| {
        let text = text.to_ascii_lowercase();
        LOGIN_WORDS.iter().any(|word| text.contains(word))
    });
    login_like || route.limits.iter().any(|limit| limit.counts_failures())
}

/// The ways PHP reaches the login of `routes[index]` without its limits.
fn login_reached_around(routes: &[RouteConfig], index: usize) -> Vec<String> {
    let route = &routes[index];
    let key = format!("routes[{index}] ({})", route.name);
    let path = route.path.as_str();
    let mut warnings = Vec::new();
    if let Some(methods) = &route.methods {
        // Where the same path goes with a method the route does not take.
        let elsewhere = routes.iter().enumerate().skip(index + 1).find(|(_, other)| {
            matches!(other.target, RouteTarget::Upstream(_))
                && (other.host.is_none() || other.host == route.host)
                && other.path.matches(path)
                && other
                    .methods
                    .as_ref()
                    .is_none_or(|theirs| theirs.iter().any(|m| !methods.contains(m)))
        });
        if let Some((other_index, other)) = elsewhere {
            let methods: Vec<&str> = methods.iter().map(|m| m.as_str()).collect();
            warnings.push(format!(
                "{key}.methods: the login's limits apply to {} only, but PHP reads the \
                 credentials from the query string too ($_GET, $_REQUEST): `GET {path}?user=...&password=...` \
                 reaches the app through routes[{other_index}] ({}) without them; leave `methods` out \
                 unless the app refuses other methods",
                methods.join(", "),
                other.name
            ));
        }
    }
    if let PathMatch::Exact(exact) = &route.path
        && !exact.ends_with('/')
    {
        warnings.push(format!(
            "{key}.path: an exact path does not match `{exact}/` or `/index.php{exact}`, which a \
             PHP front controller may answer as the same page; use `path_prefix = \"{exact}\"` \
             unless the app answers only this spelling"
        ));
    }
    warnings
}
