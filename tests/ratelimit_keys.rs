//! Limit keys through HTTP (docs/configuration.md#key-parts): each distinct header, query parameter or
//! cookie value has its own counter; an absent or empty one falls back to the client IP
//! (and cannot pose as it); a key sent twice is a 400 that never reaches the upstream;
//! query values count percent-decoded; underscore spellings of a key header are dropped.

use crate::common;

use crate::common::config::GatewayToml;
use crate::common::{TestGateway, Upstream, get, raw_request, send};
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;

/// A gateway with one route `/` limited by `limit` (2 per minute) keyed on `key`.
async fn keyed_gateway(upstream: &Upstream, key: &str, limit: u64) -> TestGateway {
    TestGateway::start(
        GatewayToml::new()
            .upstream("app", &upstream.url(), "")
            .limit(
                "keyed",
                &format!(
                    r#"algorithm = "fixed_window"
                    limit = {limit}
                    window = "1m"
                    key = [{key}]"#
                ),
            )
            .route(
                "api",
                r#"upstream = "app"
                limits = ["keyed"]"#,
            ),
    )
    .await
}

/// `GET path` with `headers`; the status.
async fn status_with(gw: &TestGateway, path: &str, headers: &[(&str, &str)]) -> u16 {
    let mut request = Request::get(gw.url(path));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    send(request.body(Full::new(Bytes::new())).unwrap())
        .await
        .0
        .as_u16()
}

#[tokio::test]
async fn each_header_value_has_its_own_counter_and_absence_falls_back_to_the_client_ip() {
    let upstream = Upstream::start().await;
    let gw = keyed_gateway(&upstream, "\"header:x-api-key\"", 2).await;
    let key = |value: &'static str| [("x-api-key", value)];

    assert_eq!(status_with(&gw, "/", &key("alice")).await, 200);
    assert_eq!(status_with(&gw, "/", &key("alice")).await, 200);
    assert_eq!(status_with(&gw, "/", &key("alice")).await, 429);
    assert_eq!(status_with(&gw, "/", &key("bob")).await, 200);

    // Without the header, the client IP is the key: a counter of its own...
    assert_eq!(status_with(&gw, "/", &[]).await, 200);
    assert_eq!(status_with(&gw, "/", &[]).await, 200);
    assert_eq!(status_with(&gw, "/", &[]).await, 429);
    // ...which an empty header falls back to as well...
    assert_eq!(status_with(&gw, "/", &key("")).await, 429);
    // ...and which a header spelling the address does not share.
    assert_eq!(status_with(&gw, "/", &key("127.0.0.1")).await, 200);

    assert_eq!(status_with(&gw, "/", &key("bob")).await, 200);
    assert_eq!(status_with(&gw, "/", &key("bob")).await, 429);
    assert_eq!(upstream.requests(), 7);
}

/// A head with more fields than hyper's parser takes hides no key field from the limit:
/// one past the 100th field counts, and one there besides another is refused.
#[tokio::test]
async fn a_key_header_past_the_hundredth_field_is_counted_and_found_twice() {
    let upstream = Upstream::start().await;
    let gw = keyed_gateway(&upstream, "\"header:x-api-key\"", 2).await;
    // The status of a request of 150 fields and the key at the places given, as sent.
    let status = |keys: &'static [(usize, &'static str)]| {
        let mut fields: Vec<String> = (0..150).map(|i| format!("x-f{i}: v")).collect();
        for (at, key) in keys {
            fields.insert(*at, format!("X-Api-Key: {key}"));
        }
        let head = format!(
            "GET / HTTP/1.1\r\nHost: h\r\n{}\r\nConnection: close\r\n\r\n",
            fields.join("\r\n")
        );
        async move {
            let answer = raw_request(gw.addr, head.as_bytes()).await;
            answer.split(' ').nth(1).unwrap_or("none").to_owned()
        }
    };
    assert_eq!(status(&[(140, "alice")]).await, "200");
    assert_eq!(status(&[(3, "alice")]).await, "200");
    assert_eq!(status(&[(145, "alice")]).await, "429");
    assert_eq!(status(&[(3, "bob"), (140, "carol")]).await, "400");
    assert_eq!(status(&[(140, "bob"), (145, "carol")]).await, "400");
    assert_eq!(upstream.requests(), 2);
}

#[tokio::test]
async fn a_key_header_sent_twice_is_a_400_that_never_reaches_the_upstream() {
    let upstream = Upstream::start().await;
    let gw = keyed_gateway(&upstream, "\"header:x-api-key\"", 2).await;

    let request = Request::get(gw.url("/"))
        .header("x-api-key", "alice")
        .header("x-api-key", "bob")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let (status, headers, body) = send(request).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::BAD_REQUEST, "Bad Request\n")
    );
    assert!(!headers.contains_key("ratelimit"), "{headers:?}");
    assert_eq!(upstream.requests(), 0);
    assert_eq!(
        gw.metric("floodgate_store_duration_seconds_count{store=\"memory\"}")
            .await,
        0.0
    );
    assert_eq!(
        gw.metric("floodgate_requests_total{route=\"api\",status=\"400\"}")
            .await,
        1.0
    );

    // Neither value was charged.
    assert_eq!(status_with(&gw, "/", &[("x-api-key", "alice")]).await, 200);
    assert_eq!(status_with(&gw, "/", &[("x-api-key", "alice")]).await, 200);
    assert_eq!(status_with(&gw, "/", &[("x-api-key", "bob")]).await, 200);
}

#[tokio::test]
async fn an_http2_value_padded_with_whitespace_is_a_400_not_a_fresh_counter() {
    // HTTP/1.1's parser trims the spaces around a value; HTTP/2 carries them, and the
    // upstream's parser would trim them again: padded, one API key would have a counter
    // per padding while the app saw the same key. RFC 9113 §8.2.1 calls such a field
    // malformed.
    let upstream = Upstream::start().await;
    let gw = keyed_gateway(&upstream, "\"header:x-api-key\"", 1).await;
    let h2 = common::h2c_client();
    let status = |value: &'static str| {
        let request = Request::get(gw.url("/"))
            .header("x-api-key", value)
            .body(Full::new(Bytes::new()))
            .unwrap();
        let response = h2.request(request);
        async move { response.await.expect("h2 request").status().as_u16() }
    };

    assert_eq!(status("alice").await, 200);
    assert_eq!(status("alice").await, 429);
    for padded in [" alice", "alice ", "alice\t", "\talice", "  alice  "] {
        assert_eq!(status(padded).await, 400, "{padded:?}");
    }
    // Inside a value, a space is the value's own.
    assert_eq!(status("alice smith").await, 200);
    assert_eq!(upstream.requests(), 2);
    // Refused before routing, under no route's name.
    assert_eq!(
        gw.metric("floodgate_requests_total{route=\"\",status=\"400\"}")
            .await,
        5.0
    );
}

#[tokio::test]
async fn query_keys_count_decoded_values_and_refuse_repeats() {
    let upstream = Upstream::start().await;
    let gw = keyed_gateway(&upstream, "\"query:key\"", 1).await;

    assert_eq!(status_with(&gw, "/q?key=%61", &[]).await, 200);
    assert_eq!(status_with(&gw, "/q?key=a", &[]).await, 429);
    assert_eq!(status_with(&gw, "/other?x=1&key=a", &[]).await, 429);
    assert_eq!(status_with(&gw, "/q?key=b", &[]).await, 200);
    assert_eq!(status_with(&gw, "/q?key=a+b", &[]).await, 200);
    assert_eq!(status_with(&gw, "/q?key=a%20b", &[]).await, 429);

    // Absent: the client IP's counter.
    assert_eq!(status_with(&gw, "/q?other=1", &[]).await, 200);
    assert_eq!(status_with(&gw, "/q", &[]).await, 429);

    let (status, _, body) = get(&gw.url("/q?key=c&key=d")).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::BAD_REQUEST, "Bad Request\n")
    );
    assert_eq!(upstream.requests(), 4);
    // The query is forwarded as received.
    let (_, _, body) = get(&gw.url("/q?key=%63")).await;
    assert!(body.starts_with("GET /q?key=%63\n"), "{body}");
}

#[tokio::test]
async fn cookie_keys_find_the_cookie_wherever_it_is_in_the_header() {
    let upstream = Upstream::start().await;
    let gw = keyed_gateway(&upstream, "\"cookie:session\"", 1).await;
    let cookie = |value: &'static str| [("cookie", value)];

    assert_eq!(
        status_with(&gw, "/", &cookie("session=abc; theme=dark")).await,
        200
    );
    assert_eq!(
        status_with(&gw, "/", &cookie("theme=light; session=abc")).await,
        429
    );
    assert_eq!(status_with(&gw, "/", &cookie("session=xyz")).await, 200);
    // A cookie that only ends in the name is another cookie: the client IP decides.
    assert_eq!(status_with(&gw, "/", &cookie("my_session=abc")).await, 200);
    assert_eq!(status_with(&gw, "/", &[]).await, 429);

    let twice = [("cookie", "session=one"), ("cookie", "session=two")];
    assert_eq!(status_with(&gw, "/", &twice).await, 400);
    assert_eq!(upstream.requests(), 3);
}

#[tokio::test]
async fn underscore_spellings_of_a_key_header_never_reach_the_upstream() {
    let upstream = Upstream::start().await;
    let gw = keyed_gateway(&upstream, "\"header:x-api-key\"", 5).await;

    let raw = raw_request(
        gw.addr,
        b"GET /u HTTP/1.1\r\nHost: h\r\nX_Api_Key: planted\r\nx-api_key: planted2\r\n\
          X-Api-Key: real\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(raw.starts_with("HTTP/1.1 200"), "{raw}");
    let description = raw.split("\r\n\r\n").nth(1).unwrap_or_default();
    assert_eq!(common::header_lines(description, "x-api-key"), ["real"], "{raw}");
    assert!(!description.to_ascii_lowercase().contains("planted"), "{raw}");

    // The gateway counted the real header: "real" now has 4 of 5 left.
    assert!(raw.contains("\"keyed\";r=4;"), "{raw}");
    assert_eq!(upstream.requests(), 1);
}

/// PHP reads `X.Api.Key` as `HTTP_X_API_KEY`: a decoy in the real header and the key the
/// app uses in a dotted one would be counted under the decoy. The dotted one never
/// reaches the app.
#[tokio::test]
async fn a_dotted_spelling_of_a_key_header_never_reaches_the_upstream() {
    let upstream = Upstream::start().await;
    let gw = keyed_gateway(&upstream, "\"header:x-api-key\"", 5).await;

    let raw = raw_request(
        gw.addr,
        b"GET /u HTTP/1.1\r\nHost: h\r\nX-Api-Key: decoy\r\nX.Api.Key: REAL\r\n\
          X.API_KEY: REAL\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(raw.starts_with("HTTP/1.1 200"), "{raw}");
    let description = raw.split("\r\n\r\n").nth(1).unwrap_or_default();
    assert_eq!(common::header_lines(description, "x-api-key"), ["decoy"], "{raw}");
    assert!(!description.contains("REAL"), "{raw}");
}

/// PHP folds `.`, ` ` and an unclosed `[` in query and cookie names into `_` (and reads
/// `a[x]` as `a`): `?api_key=decoy&api.key=REAL` would be counted under the decoy while
/// PHP reads REAL. Every spelling is the same name, so two of them are a 400.
#[tokio::test]
async fn names_php_folds_together_are_one_query_or_cookie_key() {
    let upstream = Upstream::start().await;
    let gw = keyed_gateway(&upstream, "\"query:api_key\"", 2).await;
    for aliased in [
        "/q?api_key=decoy&api.key=REAL",
        "/q?api_key=decoy&api%2Ekey=REAL",
        "/q?api.key=REAL&api+key=decoy",
        "/q?api_key=decoy&api[key=REAL",
        "/q?api_key=decoy&%20api_key=REAL",
        "/q?api_key=decoy&api_key%00x=REAL",
        "/q?api_key=decoy&api_key[]=REAL",
    ] {
        assert_eq!(status_with(&gw, aliased, &[]).await, 400, "{aliased}");
    }
    assert_eq!(upstream.requests(), 0);
    // One counter, whatever the spelling.
    assert_eq!(status_with(&gw, "/q?api.key=REAL", &[]).await, 200);
    assert_eq!(status_with(&gw, "/q?api%20key=REAL", &[]).await, 200);
    assert_eq!(status_with(&gw, "/q?api_key=REAL", &[]).await, 429);

    let gw = keyed_gateway(&upstream, "\"cookie:api_key\"", 1).await;
    let cookie = |value: &'static str| [("cookie", value)];
    assert_eq!(
        status_with(&gw, "/", &cookie("api_key=decoy; api.key=REAL")).await,
        400
    );
    assert_eq!(status_with(&gw, "/", &cookie("api%2Ekey=REAL")).await, 200);
    assert_eq!(status_with(&gw, "/", &cookie("api_key=RE%41L")).await, 429);
}

/// A `path` key on a script route (`path = "/login.php"`) counts the script, whatever
/// PATH_INFO follows it: `/login.php/1` runs the same script and is no fresh counter.
#[tokio::test]
async fn a_script_routes_path_key_is_the_script_whatever_follows_it() {
    let gw = TestGateway::start(
        GatewayToml::new()
            .limit(
                "login",
                r#"algorithm = "fixed_window"
                limit = 2
                window = "1m"
                key = ["client_ip", "path"]"#,
            )
            .route(
                "login",
                r#"path = "/login.php"
                respond = { status = 401, body = "no\n" }
                limits = ["login"]"#,
            ),
    )
    .await;
    let mut statuses = Vec::new();
    for path in [
        "/login.php",
        "/login.php/1",
        "/login.php/2",
        "/login.php%2F3",
        "/login.php/4/",
    ] {
        statuses.push(status_with(&gw, path, &[]).await);
    }
    assert_eq!(statuses, [401, 401, 429, 429, 429]);
}
