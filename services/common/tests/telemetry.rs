//! Logging without span export builds no spans: its own process, since the subscriber is
//! global.

/// The log layer wants events only. Were spans built anyway (an absent exporter layer still
/// declaring interest in every callsite), every request would pay for h2's, tonic's and the
/// router's spans in the registry only to drop them: the most a router spent on anything of
/// its own in a profile under load.
#[test]
fn without_an_exporter_no_span_is_built() {
    let otlp = ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"];
    if let Some(v) = otlp.iter().find(|v| std::env::var_os(v).is_some()) {
        eprintln!("{v} is set here: spans are exported, nothing to check");
        return;
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let t = {
        let _in = rt.enter();
        pdmesh_common::telemetry::init("pdmesh-test").expect("logging starts")
    };
    assert!(!t.exporting());
    assert!(tracing::info_span!("router.generate").is_disabled());
    assert!(tracing::trace_span!(target: "h2", "poll").is_disabled());
    assert!(
        tracing::enabled!(kind: tracing::metadata::Kind::EVENT, tracing::Level::ERROR),
        "events are still logged"
    );
}
