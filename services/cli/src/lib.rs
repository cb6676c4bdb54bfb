//! The `pdmesh` command's library half: the engine options every local command shares and the
//! handling of child processes, used by the `pdmesh` binary and by the tools binary
//! (`pdmesh-tools`: benchmarks, trace replay, the trace collector).

pub mod args;
pub mod client;
pub mod netns;
pub mod process;

/// The error and its causes, leaving out a cause whose words are already in the message
/// before it: many errors embed their source's message and name it as the source too, and
/// the reason should read once.
pub fn describe(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let m = cause.to_string();
        if out.contains(&m) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&m);
    }
    out
}

#[cfg(test)]
mod tests {
    /// As `thiserror` makes `#[error("loading the engine: {0}")] Wraps(#[from] io::Error)`.
    #[derive(Debug)]
    struct Wraps(std::io::Error);

    impl std::fmt::Display for Wraps {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "loading the engine: {}", self.0)
        }
    }

    impl std::error::Error for Wraps {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_cause_already_in_the_message_is_said_once() {
        let inner = std::io::Error::other("no CUDA driver");
        let e = anyhow::Error::new(Wraps(inner)).context("starting decode");
        assert_eq!(super::describe(&e), "starting decode: loading the engine: no CUDA driver");
        let plain = anyhow::anyhow!("bare").context("outer");
        assert_eq!(super::describe(&plain), "outer: bare");
    }
}
