//! `--sim-nodes N`: one process hosting N simulated nodes (`--engine sim`), each with its own
//! listener, name and router sessions, for studying a mesh larger than the machine.

use anyhow::Context;
use pdmesh_common::metrics::Metrics;

use super::{Listeners, Service, Shutdown, bind_and_announce};

/// `--sim-nodes N` hosts N simulated nodes, which share this process's identity: only
/// simulated engines, only plaintext on loopback, and no one metrics page for all of them.
pub(super) fn check<C: Service>(cfg: &C, n: usize) -> anyhow::Result<()> {
    anyhow::ensure!((1..=10_000).contains(&n), "--sim-nodes {n} must be in 1..=10000");
    anyhow::ensure!(
        cfg.engine().is_some_and(|e| e.engine == pdmesh_engine::EngineName::Sim),
        "--sim-nodes hosts simulated nodes: add --engine sim"
    );
    anyhow::ensure!(
        pdmesh_common::tls::current().is_none(),
        "--sim-nodes runs several nodes under one process, so under no one certificate: use \
         --insecure (loopback only)"
    );
    anyhow::ensure!(
        cfg.metrics_listen().is_none(),
        "--metrics-listen serves one node's metrics; with --sim-nodes read the router's"
    );
    Ok(())
}

/// The address node `i` of a fleet listens on: port 0 stays 0, port P becomes P + i; on
/// 127.0.0.1, each node takes a loopback address of its own (127.1.x.y), and calls routers
/// from it: a thousand nodes' sessions from one address would pass a router's per-address
/// connection limit (512), and be refused as one peer flooding it would be.
fn listen_of(listen: &str, i: usize) -> anyhow::Result<String> {
    let (host, port) = listen
        .rsplit_once(':')
        .with_context(|| format!("listen {listen:?}: expected host:port"))?;
    let port: u16 = port.parse().with_context(|| format!("listen {listen:?}: bad port"))?;
    let host = if host == "127.0.0.1" {
        // 10,000 nodes at most (`check`): 40 × 250 addresses.
        format!("127.1.{}.{}", i / 250, i % 250 + 1)
    } else {
        host.to_string()
    };
    if port == 0 {
        return Ok(format!("{host}:0"));
    }
    let p = u16::try_from(usize::from(port) + i)
        .ok()
        .with_context(|| format!("listen {listen:?}: port {port} + {i} is past 65535"))?;
    Ok(format!("{host}:{p}"))
}

/// Runs `n` copies of a simulated node until `shutdown`, or until one of them fails (which
/// stops the rest: a fleet half up would misreport the study it serves).
pub(super) async fn run<C: Service>(
    mut cfg: C,
    n: usize,
    shutdown: Shutdown,
) -> anyhow::Result<()> {
    let stop = tokio_util::sync::CancellationToken::new();
    tokio::spawn({
        let stop = stop.clone();
        async move {
            shutdown.await;
            stop.cancel();
        }
    });
    let name = cfg.node_id().and_then(|id| id.clone()).unwrap_or_else(|| C::NAME.to_string());
    let mut nodes = tokio::task::JoinSet::new();
    for i in 0..n {
        let mut c = cfg.clone();
        let listen = listen_of(cfg.listen(), i)?;
        c.set_listen(listen.clone());
        if let Some(id) = c.node_id() {
            *id = Some(format!("{name}-{i}"));
        }
        let main = bind_and_announce(C::NAME, &listen, "listening on").await?;
        let l = Listeners { main, internal: None, http: None };
        let stopped = Box::pin(stop.clone().cancelled_owned());
        nodes.spawn(c.run(l, Metrics::default(), stopped));
    }
    tracing::info!(nodes = n, "simulated nodes started");
    let mut first_error = None;
    while let Some(done) = nodes.join_next().await {
        let r = done.map_err(anyhow::Error::from).and_then(|r| r);
        if let Err(e) = r {
            stop.cancel();
            first_error.get_or_insert(e);
        }
    }
    first_error.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::listen_of;

    #[test]
    fn fleet_nodes_on_loopback_take_addresses_of_their_own() {
        let at = |l: &str, i| listen_of(l, i).unwrap();
        assert_eq!(at("127.0.0.1:0", 0), "127.1.0.1:0");
        assert_eq!(at("127.0.0.1:0", 9_999), "127.1.39.250:0");
        assert_eq!(at("127.0.0.1:7000", 251), "127.1.1.2:7251");
        assert_eq!(at("[::1]:0", 3), "[::1]:0", "only 127.0.0.1 is spread");
        assert!(listen_of("127.0.0.1:65535", 1).unwrap_err().to_string().contains("past 65535"));
    }
}
