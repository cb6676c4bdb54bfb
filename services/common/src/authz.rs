//! Who may call what. Every internal method names the roles whose certificates may call it
//! (the router drives nodes; prefill nodes move KV and fill the store; nodes keep their
//! membership); `AuthzLayer` on every server checks the caller's certificate against that
//! table before the call reaches a handler, and leaves the caller's [`Peer`] in the request's
//! extensions for handlers that care which node it is. Without TLS (`--insecure`) nothing is
//! checked: that mode is for one machine's experiments and binds loopback only.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context as TaskCx, Poll};

use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

use crate::tls::{MeshRole, Peer};

/// Who may call a method.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Anyone who reaches the listener (the public API authenticates by API key instead;
    /// health checks and reflection reveal nothing).
    Anyone,
    /// Callers whose certificate carries one of these roles.
    Roles(&'static [MeshRole]),
}

use MeshRole::{Admin, Decode, KvStore, Prefill, Router};

/// The table: `/package.Service/Method` → who may call it. Unknown methods: no one.
pub fn access(path: &str) -> Access {
    let Some((service, method)) = path.strip_prefix('/').and_then(|p| p.split_once('/')) else {
        return Access::Roles(&[]);
    };
    match (service, method) {
        ("pdmesh.v1.Generation", _) | ("grpc.health.v1.Health", _) => Access::Anyone,
        (s, _) if s.starts_with("grpc.reflection.") => Access::Anyone,
        ("pdmesh.v1.Membership", "Attach" | "Register" | "Heartbeat" | "Deregister") => {
            Access::Roles(&[Prefill, Decode, KvStore])
        }
        ("pdmesh.v1.Membership", "ListNodes") => Access::Roles(&[Router, Admin]),
        ("pdmesh.v1.Prefill", "Prefill") => Access::Roles(&[Router]),
        ("pdmesh.v1.Decode", "Reserve" | "Release" | "Decode" | "HandOff" | "CancelRequest") => {
            Access::Roles(&[Router])
        }
        // A draining decode node moves its requests' KV to another decode node.
        ("pdmesh.v1.Decode", "PushKv" | "KvSession") => Access::Roles(&[Prefill, Decode]),
        ("pdmesh.v1.Decode", "Drain") => Access::Roles(&[Admin]),
        ("pdmesh.v1.KvStore", "Match" | "ReleaseMatch" | "Read" | "Write") => {
            Access::Roles(&[Prefill])
        }
        ("pdmesh.v1.Prefill" | "pdmesh.v1.Decode", "Stats") => Access::Roles(&[Router, Admin]),
        ("pdmesh.v1.KvStore", "Stats") => Access::Roles(&[Router, Prefill, Admin]),
        _ => Access::Roles(&[]),
    }
}

/// The verified caller of a request on a TLS listener, if it presented a certificate.
fn peer_of<B>(req: &http::Request<B>) -> Option<Peer> {
    let info = req.extensions().get::<TlsConnectInfo<TcpConnectInfo>>()?;
    let certs = info.peer_certs()?;
    Peer::from_der(certs.first()?)
}

/// Whether a caller (`None`: no certificate) may call `path`; the status to answer if not.
pub fn check(path: &str, peer: Option<&Peer>) -> Result<(), tonic::Status> {
    match (access(path), peer) {
        (Access::Anyone, _) => Ok(()),
        (Access::Roles(_), None) => Err(tonic::Status::unauthenticated(format!(
            "{path} needs a mesh certificate (mutual TLS); none was presented"
        ))),
        (Access::Roles(roles), Some(p)) if roles.contains(&p.role) => Ok(()),
        (Access::Roles(roles), Some(p)) => Err(tonic::Status::permission_denied(format!(
            "{path} is for {}; {} is a {}",
            if roles.is_empty() {
                "no one".to_string()
            } else {
                roles.iter().map(|r| r.name()).collect::<Vec<_>>().join(" or ")
            },
            p.name,
            p.role
        ))),
    }
}

/// The caller a handler is serving, when the mesh runs with TLS.
pub fn caller<T>(req: &tonic::Request<T>) -> Option<&Peer> {
    req.extensions().get::<Peer>()
}

/// `Server::builder().layer(AuthzLayer { enforce })`: see the module docs. `enforce` is
/// false only without TLS.
#[derive(Debug, Clone, Copy)]
pub struct AuthzLayer {
    pub enforce: bool,
}

impl<S> tower::Layer<S> for AuthzLayer {
    type Service = AuthzService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        AuthzService { inner, enforce: self.enforce }
    }
}

#[derive(Debug, Clone)]
pub struct AuthzService<S> {
    inner: S,
    enforce: bool,
}

impl<S, B> tower::Service<http::Request<B>> for AuthzService<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut TaskCx<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        if !self.enforce {
            return Box::pin(inner.call(req));
        }
        // Public calls need no identity: their certificate (if any) is not even parsed.
        let peer = match access(req.uri().path()) {
            Access::Anyone => None,
            Access::Roles(_) => peer_of(&req),
        };
        if let Err(status) = check(req.uri().path(), peer.as_ref()) {
            tracing::warn!(path = req.uri().path(), ?peer, "refused: {}", status.message());
            return Box::pin(async move { Ok(status.into_http()) });
        }
        if let Some(p) = peer {
            req.extensions_mut().insert(p);
        }
        Box::pin(inner.call(req))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(role: MeshRole) -> Peer {
        Peer { role, name: format!("{role}-0") }
    }

    #[test]
    fn each_role_reaches_only_its_own_calls() {
        let cases: &[(&str, &[MeshRole])] = &[
            ("/pdmesh.v1.Decode/Reserve", &[Router]),
            ("/pdmesh.v1.Decode/Decode", &[Router]),
            ("/pdmesh.v1.Decode/Release", &[Router]),
            ("/pdmesh.v1.Decode/PushKv", &[Prefill, Decode]),
            ("/pdmesh.v1.Decode/KvSession", &[Prefill, Decode]),
            ("/pdmesh.v1.Decode/HandOff", &[Router]),
            ("/pdmesh.v1.Decode/CancelRequest", &[Router]),
            ("/pdmesh.v1.Decode/Drain", &[Admin]),
            ("/pdmesh.v1.Prefill/Prefill", &[Router]),
            ("/pdmesh.v1.KvStore/Write", &[Prefill]),
            ("/pdmesh.v1.KvStore/Read", &[Prefill]),
            ("/pdmesh.v1.Membership/Heartbeat", &[Prefill, Decode, KvStore]),
            ("/pdmesh.v1.Membership/Attach", &[Prefill, Decode, KvStore]),
            ("/pdmesh.v1.Membership/ListNodes", &[Router, Admin]),
            ("/pdmesh.v1.Decode/Stats", &[Router, Admin]),
            ("/pdmesh.v1.Decode/Unknown", &[]),
            ("/evil.Service/Call", &[]),
            ("garbage", &[]),
        ];
        for (path, allowed) in cases {
            for role in MeshRole::ALL {
                let r = check(path, Some(&peer(role)));
                assert_eq!(r.is_ok(), allowed.contains(&role), "{path} as {role}");
                if let Err(s) = r {
                    assert_eq!(s.code(), tonic::Code::PermissionDenied);
                }
            }
            let anonymous = check(path, None).unwrap_err();
            assert_eq!(anonymous.code(), tonic::Code::Unauthenticated, "{path}");
        }
        for path in ["/pdmesh.v1.Generation/Generate", "/grpc.health.v1.Health/Check"] {
            assert!(check(path, None).is_ok());
        }
    }
}
