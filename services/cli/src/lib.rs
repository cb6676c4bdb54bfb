//! The `pdmesh` command's library half: the engine options every local command shares and the
//! handling of child processes, used by the `pdmesh` binary and by the tools binary
//! (`pdmesh-tools`: benchmarks, trace replay, the trace collector).

pub mod args;
pub mod client;
pub mod process;
