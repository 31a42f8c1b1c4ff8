//! Requests to a route with a site (`root`, docs/configuration.md#routesroot): which file
//! the path comes to, the file itself when it is not a script, and what PHP-FPM is told
//! when it is (docs/php-fpm.md).

use std::time::Duration;

use http::header::{self, HeaderValue};
use http::request::Parts;
use http::{Response, Version};

use super::own_answer::OwnAnswer;
use super::response_body::Payload;
use crate::config::{Php, Site};
use crate::error::GatewayError;
use crate::files::Opened;
use crate::files::choice::{self, Choice, Script};
use crate::files::serve;
use crate::path::decode_file_path;
use crate::proxy::headers::AsForwarded;
use crate::proxy::headers::ForwardingContext;
use crate::proxy::request_body::RequestBody;
use crate::proxy::spool::spool;
use crate::room::Room;
use crate::trace::RequestTrace;
use crate::trace::context::{self, SpanId};
use crate::upstream::FastCgiHead;
use crate::upstream::fastcgi::params::{Call, Caller, Headers, request_head};

/// What a request to a site comes to, besides an answer.
pub(super) enum Prepared {
    /// PHP-FPM runs this script.
    Run(Script),
    /// No file: the upstream's to answer (for a route with an HTTP upstream; `404`
    /// otherwise).
    Unserved,
}

/// What `request` comes to on `site`, for its normalized `path` (after `strip_prefix`;
/// `asked`, before it); in `Err`, the answer instead: the file, a `308` to the directory
/// (named as the client asked for it), a `404` for a hidden path or one outside the root,
/// a `400` for a path that names no file, a `503` when the file could not be held open
/// (no place in `room`, or the process out of descriptors).
pub(super) async fn prepare(
    site: &Site,
    (path, asked): (&str, &str),
    request: &Parts,
    room: &Room,
) -> Result<Prepared, Result<Response<Payload>, OwnAnswer>> {
    let file_path = decode_file_path(path).map_err(|error| Err(GatewayError::BadPath(error).into()))?;
    let split_path = site.php.as_ref().map(|php| php.split_path.as_str());
    match choice::choose(&site.root, &file_path, &site.index, split_path) {
        Choice::Run(script) => Ok(Prepared::Run(script)),
        Choice::Nothing => Ok(Prepared::Unserved),
        Choice::Serve(file_path, file) => Err(serve_file(site, &file_path, file, request, room)),
        Choice::Hidden => Err(Err(GatewayError::NotFound.into())),
        Choice::Unavailable => Err(Err(GatewayError::OutOfDescriptors.into())),
        Choice::AddSlash(_) => {
            // Relative, the path the client asked for, with its query.
            let location = match request.uri.query() {
                Some(query) => format!("{asked}/?{query}"),
                None => format!("{asked}/"),
            };
            Err(Err(match HeaderValue::try_from(location) {
                Ok(location) => OwnAnswer::Redirect(location),
                Err(_) => GatewayError::MalformedRequest("the request target cannot be redirected").into(),
            }))
        }
    }
}

/// The answer to `request` with `file`, at `path` on `site`: a file that streams (one too
/// large to be read at once) is held open in a place in `room`, a file read at once holds
/// its bytes in `room`'s memory until they are sent; a `503` when the room has neither.
fn serve_file(
    site: &Site,
    path: &str,
    file: Opened,
    request: &Parts,
    room: &Room,
) -> Result<Response<Payload>, OwnAnswer> {
    match serve::serve(&site.root, path, file, &request.method, &request.headers) {
        Ok(response) => {
            let (head, body) = response.into_parts();
            let body = body.held_in(room).ok_or(GatewayError::NoFilePlace)?;
            Ok(Response::from_parts(head, Payload::File(Box::new(body))))
        }
        Err(status) if status == http::StatusCode::METHOD_NOT_ALLOWED => {
            Err(GatewayError::NotAFileMethod.into())
        }
        Err(_) => Err(GatewayError::NotFound.into()),
    }
}

/// What PHP-FPM is told of the request in `parts` (its headers as they go upstream, its
/// target and version as the client sent them) running `script`: its headers are
/// `as_forwarded` when given (`parts` then holds them as the client sent them); `host` is
/// the name the client asked for, `content_length` the body's when it has framing; `trace`
/// names the first try's span as the parent, which a later try writes over with its own.
pub(super) fn fastcgi_head(
    (parts, as_forwarded): (&Parts, Option<&AsForwarded<'_>>),
    script: &Script,
    context: &ForwardingContext<'_>,
    (host, content_length): (Option<&str>, Option<u64>),
    php: &Php,
    env: &[(String, String)],
    trace: &RequestTrace,
) -> Result<FastCgiHead, GatewayError> {
    let target = parts.uri.path_and_query().map_or("/", |target| target.as_str());
    let first_try = SpanId::random();
    let call = Call {
        method: &parts.method,
        version: context.version,
        target,
        query: parts.uri.query().unwrap_or(""),
        headers: match as_forwarded {
            Some(headers) => Headers::AsForwarded(headers),
            None => Headers::Rewritten(&parts.headers),
        },
        content_length,
        traceparent: &context::traceparent(&trace.trace_id, &first_try, trace.flags),
    };
    let address = context.peer.text_of(context.client_ip);
    let caller = Caller {
        address: &address,
        port: context.peer.address.port(),
        server_name: host.unwrap_or(""),
        server_port: context.peer.local_port,
        https: context.peer.tls,
    };
    let head =
        request_head(&call, script, &caller, &php.root, env).map_err(|_| GatewayError::ParameterTooLong)?;
    Ok(FastCgiHead {
        span: Some(first_try),
        ..head
    })
}

/// The length PHP-FPM is told of a request without a body: the declared length, `0` for
/// a body-framed request, nothing without framing.
pub(super) fn length_without_body(parts: &Parts, declared: Option<u64>) -> Option<u64> {
    let framed = parts.version < Version::HTTP_2 && parts.headers.contains_key(header::TRANSFER_ENCODING);
    declared.or(framed.then_some(0))
}

/// `body` read whole, and its length (which PHP-FPM must be told, also of a chunked
/// body): read before PHP-FPM, or an HTTP server under `max_requests`, is contacted, so
/// that a client sending its body slowly holds no worker and no slot meanwhile. A body
/// that needs a temporary file waits up to `wait` for a place in `room`.
pub(super) async fn read_whole(
    body: RequestBody,
    room: &Room,
    wait: Duration,
) -> Result<(Option<u64>, RequestBody), OwnAnswer> {
    let spooled = spool(body, room, wait)
        .await
        .map_err(|error| error.answer(error.to_string()))?;
    Ok((Some(spooled.len()), RequestBody::spooled(spooled)))
}
