//! What every pdmesh service shares: config loading (defaults → TOML → env → flags), serving a
//! tonic router with health and reflection and a bounded drain, the membership client that
//! registers a node with its routers and heartbeats its load, deadlines from `grpc-timeout`,
//! request ids, the engine thread every worker node runs, and telemetry: logging, tracing (W3C
//! propagation, OTLP export, a receiver for tests) and Prometheus metrics.

pub mod apikey;
pub mod authz;
pub mod blocks;
pub mod channels;
#[cfg(feature = "collector")]
pub mod collector;
pub mod config;
pub mod convert;
pub mod deadline;
pub mod gate;
pub mod ids;
pub mod membership;
pub mod metrics;
pub mod node;
pub mod serve;
pub mod status;
pub mod telemetry;
pub mod tls;
pub mod trace;
pub mod worker;

pub use config::{ConfigError, InvalidConfig, load_config};
pub use serve::{Exposure, bind, serve};
