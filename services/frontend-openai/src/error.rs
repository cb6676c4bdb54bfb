//! The API's errors: an HTTP status and the error object its clients parse (the SDK raises a
//! typed exception per status). Each router failure maps to one status, by a match that names
//! every variant.

use std::time::Duration;

use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode};
use pdmesh_router::RequestError;
use tonic::Code;

use crate::schema::{ErrorBody, ErrorObject};

/// Why a call failed, as the API reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// The request parameter at fault, when one is.
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// With 429 and 503: when to try again (`Retry-After`).
    pub retry_after: Option<Duration>,
}

impl ApiError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self { status, message: message.into(), param: None, code: None, retry_after: None }
    }

    /// A bad value of `param`; the message says what is wrong and what is accepted.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        let param = param.into();
        let message = format!("{param}: {}", message.into());
        Self { param: Some(param), ..Self::new(StatusCode::BAD_REQUEST, message) }
    }

    /// A bad value of `param`, with a message that already names it.
    pub fn param(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self { param: Some(param.into()), ..Self::new(StatusCode::BAD_REQUEST, message) }
    }

    /// A body that is not a request at all (not JSON, not an object).
    pub fn malformed(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    pub fn unauthenticated(message: impl Into<String>) -> Self {
        Self { code: Some("invalid_api_key"), ..Self::new(StatusCode::UNAUTHORIZED, message) }
    }

    pub fn unknown_model(model: &str, served: &str) -> Self {
        Self {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                format!("The model `{model}` does not exist; this server serves `{served}`"),
            )
        }
    }

    pub fn not_found(path: &str) -> Self {
        Self::new(StatusCode::NOT_FOUND, format!("no such endpoint: {path}"))
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    /// A body past the limit (413).
    pub fn too_large(limit: usize) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, format!("the request body is over {limit} bytes"))
    }

    /// A body that did not arrive in time (408).
    pub fn body_timeout(after: Duration) -> Self {
        Self::new(
            StatusCode::REQUEST_TIMEOUT,
            format!("the request body did not arrive within {after:?}"),
        )
    }

    /// The `type` of the error object, as OpenAI names them.
    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::BAD_REQUEST
            | StatusCode::NOT_FOUND
            | StatusCode::CONFLICT
            | StatusCode::PAYLOAD_TOO_LARGE
            | StatusCode::REQUEST_TIMEOUT => "invalid_request_error",
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::FORBIDDEN => "permission_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable_error",
            StatusCode::GATEWAY_TIMEOUT => "timeout_error",
            _ => "server_error",
        }
    }

    /// The error object, for a body or a stream's last event.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorObject {
                message: self.message.clone(),
                kind: self.kind(),
                param: self.param.clone(),
                code: self.code,
            },
        }
    }
}

impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> Self {
        let message = e.to_string();
        match e {
            RequestError::Invalid(_) => Self::new(StatusCode::BAD_REQUEST, message),
            RequestError::Overloaded { retry_after, .. } => Self {
                retry_after: Some(retry_after),
                code: Some("rate_limit_exceeded"),
                ..Self::new(StatusCode::TOO_MANY_REQUESTS, message)
            },
            RequestError::Duplicate(_) => Self::new(StatusCode::CONFLICT, message),
            RequestError::Unavailable(_) => Self::new(StatusCode::SERVICE_UNAVAILABLE, message),
            RequestError::Deadline(_) => Self::new(StatusCode::GATEWAY_TIMEOUT, message),
            RequestError::Node(s) => Self::from_code(s.code(), message, status_retry(&s)),
        }
    }
}

impl ApiError {
    /// The HTTP status for a gRPC code a node answered with.
    fn from_code(code: Code, message: String, retry_after: Option<Duration>) -> Self {
        let status = match code {
            Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => {
                StatusCode::BAD_REQUEST
            }
            Code::Unauthenticated => StatusCode::UNAUTHORIZED,
            Code::PermissionDenied => StatusCode::FORBIDDEN,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
            Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
            Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            // The client went away: no one reads this, but it is not a server fault.
            Code::Cancelled => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
            Code::Ok | Code::Unknown | Code::Unimplemented | Code::Internal | Code::DataLoss => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        };
        Self { retry_after, ..Self::new(status, message) }
    }
}

/// The retry hint a node's RESOURCE_EXHAUSTED carries.
fn status_retry(s: &tonic::Status) -> Option<Duration> {
    (s.code() == Code::ResourceExhausted).then(|| pdmesh_common::status::retry_after(s)).flatten()
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let retry = self.retry_after;
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(d) = retry {
            // Whole seconds, rounded up: Retry-After has no fractions.
            let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
            if let Ok(v) = HeaderValue::from_str(&secs.max(1).to_string()) {
                r.headers_mut().insert(http::header::RETRY_AFTER, v);
            }
        }
        r
    }
}
