//! `pdmesh` as a user runs it: real process, real model.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::io::Read;
use std::process::Stdio;

use pdmesh_integration::{child_pid, model_path, pdmesh, pdmesh_bin, run, spawn_up};

#[test]
fn run_json_greedy_matches_llama_cpp() {
    let (code, out, err) = run(pdmesh(&[
        "run",
        "--prompt",
        "What causes the seasons on Earth?",
        "--max-tokens",
        "16",
        "--json",
    ]));
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).expect("one JSON object on stdout");
    let ids: Vec<u64> =
        v["token_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect();
    // llama.cpp 0.3.36, greedy, same GGUF.
    assert_eq!(
        ids,
        [504, 2591, 506, 12064, 335, 624, 6867, 359, 2952, 411, 260, 27067, 282, 624, 6867, 30]
    );
    assert_eq!(v["text"], "The Earth's seasons on its axis are caused by the tilt of its axis.");
    assert_eq!(v["finish_reason"], "length");
    assert_eq!(v["prompt_tokens"], 37);
}

#[test]
fn run_streams_text_and_raw_mode_parses_special_tokens() {
    let raw = "<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n";
    let (code, out, err) = run(pdmesh(&["run", "--raw", "--prompt", raw, "--max-tokens", "8"]));
    assert_eq!(code, 0, "{err}");
    assert!(!out.trim().is_empty(), "no text streamed");
    // Special tokens were parsed as one token each: spelled out they would take ~30.
    assert!(err.contains("[12 prompt tokens"), "{err}");
    let (code, _, err) = run(pdmesh(&[
        "run",
        "--prompt",
        "Hi",
        "--max-tokens",
        "4",
        "--seed",
        "3",
        "--temperature",
        "0.8",
    ]));
    assert_eq!(code, 0, "{err}");
}

#[test]
fn sampling_with_a_seed_is_reproducible_across_processes() {
    let args = [
        "run",
        "--prompt",
        "Tell me a story.",
        "--max-tokens",
        "12",
        "--temperature",
        "1.0",
        "--seed",
        "42",
        "--json",
    ];
    let (c1, a, e1) = run(pdmesh(&args));
    let (c2, b, e2) = run(pdmesh(&args));
    assert!(c1 == 0 && c2 == 0, "{e1}{e2}");
    let ids =
        |s: &str| serde_json::from_str::<serde_json::Value>(s.trim()).unwrap()["token_ids"].clone();
    assert_eq!(ids(&a), ids(&b));
}

#[test]
fn perplexity_ends_with_the_value() {
    let dir = std::env::temp_dir().join(format!("pdmesh-ppl-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ppl_of = |name: &str, text: &str| -> f64 {
        let file = dir.join(name);
        std::fs::write(&file, text).unwrap();
        let (code, out, err) =
            run(pdmesh(&["perplexity", "--file", file.to_str().unwrap(), "--ctx", "64"]));
        assert_eq!(code, 0, "{err}");
        let last = out.trim().lines().last().unwrap();
        last.strip_prefix("perplexity: ").expect("last line format").parse().unwrap()
    };
    let sentence = "The quick brown fox jumps over the lazy dog. ";
    let repeated = ppl_of("repeated.txt", &sentence.repeat(40));
    // The same words in a scrambled order every time cannot be predicted nearly as well.
    let words: Vec<&str> = sentence.split_whitespace().collect();
    let scrambled: String = (0..40 * words.len())
        .map(|i| words[(i * 7 + i / 9) % words.len()])
        .collect::<Vec<_>>()
        .join(" ");
    let scrambled = ppl_of("scrambled.txt", &scrambled);
    assert!(repeated > 1.0 && repeated < 5.0, "{repeated}");
    assert!(scrambled > 2.0 * repeated, "{scrambled} vs {repeated}");
    let file = dir.join("repeated.txt");
    let (code, _, err) =
        run(pdmesh(&["perplexity", "--file", file.to_str().unwrap(), "--ctx", "100000"]));
    assert_ne!(code, 0);
    assert!(err.contains("context"), "{err}");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn bench_engine_json_has_the_promised_fields() {
    let (code, out, err) = run(pdmesh(&[
        "bench",
        "engine",
        "--json",
        "--prompt-tokens",
        "16",
        "--decode-tokens",
        "4",
        "--batch-sizes",
        "1,2",
        "--batch-steps",
        "2",
        "--repeats",
        "1",
    ]));
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    for k in ["prefill_tok_s", "decode_tok_s", "peak_rss_bytes"] {
        assert!(v[k].as_f64().is_some_and(|x| x > 0.0), "{k} missing or zero: {v}");
    }
    assert!(v["batched_decode_tok_s"]["2"].as_f64().is_some_and(|x| x > 0.0), "{v}");
}

/// Each KV path moves bytes the decode node verifies (the bench fails otherwise): UCX into the
/// shared pool, UCX puts into a private one, and the gRPC stream; the references are timed too.
#[test]
fn bench_kv_moves_verified_kv_on_every_path() {
    let bench = |args: &[&str]| {
        let mut c = std::process::Command::new(pdmesh_bin());
        c.args(["bench", "kv", "--model"]).arg(model_path()).args(args);
        run(c)
    };
    let (code, out, err) = bench(&["--json", "--tokens", "64", "--reps", "1"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    for k in ["ucx_ms", "ucx_put_ms", "grpc_ms", "memcpy_ms", "tcp_ms", "grpc_vs_tcp"] {
        assert!(v[k].as_f64().is_some_and(|x| x > 0.0), "{k} missing or zero: {v}");
    }
    assert_eq!(v["tls"], true, "the gRPC stream runs over mutual TLS by default: {v}");
    // Plaintext, to see what TLS costs the stream: the transfer is still verified end to end.
    let (code, out, err) =
        bench(&["--json", "--tokens", "64", "--reps", "1", "--paths", "grpc", "--insecure"]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["tls"], false, "{v}");
    assert!(v["grpc_ms"].as_f64().is_some_and(|x| x > 0.0), "{v}");
    assert!(v["ucx_ms"].is_null(), "a path not asked for is not timed: {v}");
    let (code, _, err) = bench(&["--paths", "ucx,rdma"]);
    assert_ne!(code, 0);
    assert!(err.contains("unknown path \"rdma\""), "{err}");
}

#[test]
fn closed_stdout_stops_generation_quietly() {
    let mut child = pdmesh(&["run", "--prompt", "Count to one hundred.", "--max-tokens", "200"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 1];
    stdout.read_exact(&mut first).unwrap();
    drop(stdout); // the reader goes away, like `pdmesh run ... | head -c1`
    let status = child.wait().unwrap();
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(!err.contains("panicked"), "{err}");
    assert!(status.success(), "exit {status:?}: {err}");
}

/// `pdmesh up` supervises its mesh: a decode node killed with SIGKILL is restarted and the mesh
/// serves again with the same tokens, without the operator doing anything; `up` itself stays up.
#[test]
fn up_restarts_a_node_that_dies() {
    let home = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let addr = format!("127.0.0.1:{port}");
    let model = model_path();
    let mut c = std::process::Command::new(pdmesh_bin());
    c.args([
        "up",
        "--listen",
        &addr,
        "--http-listen",
        "127.0.0.1:0",
        "--prefill",
        "1",
        "--decode",
        "1",
    ])
    .args(["--threads", "1"])
    .args(["--kvstore-budget-bytes", "0", "--model"])
    .arg(&model)
    .env("PDMESH_HOME", home.path());
    let mut up = spawn_up(c);
    let generate = || {
        let out = std::process::Command::new(pdmesh_bin())
            .args(["generate", "--target", &addr, "--max-tokens", "6", "--json", "Name a colour."])
            .env("PDMESH_HOME", home.path())
            .output()
            .unwrap();
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let tokens = |json: &str| {
        let v: serde_json::Value = serde_json::from_str(json).unwrap();
        v["tokens"].clone()
    };
    let want = tokens(&generate().expect("the mesh serves"));
    let decode = child_pid(up.id(), "/decode-0.toml").expect("a decode node child");
    // `up` hands each child its settings as a config file: what was asked for is in it.
    let cmdline = std::fs::read(format!("/proc/{decode}/cmdline")).unwrap();
    let args: Vec<String> =
        cmdline.split(|&b| b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
    let file = &args[args.iter().position(|a| a == "--config").expect("--config") + 1];
    let config: toml::Table = std::fs::read_to_string(file).unwrap().parse().unwrap();
    assert_eq!(config["node_id"].as_str(), Some("decode-0"));
    assert_eq!(config["engine"]["threads"].as_integer(), Some(1));
    assert_eq!(config["engine"]["model"].as_str(), model.to_str());
    assert_eq!(config["routers"].as_array().map(Vec::len), Some(1));
    assert!(
        std::process::Command::new("kill")
            .args(["-9", &decode.to_string()])
            .status()
            .unwrap()
            .success()
    );
    let until = std::time::Instant::now() + std::time::Duration::from_secs(90);
    let got = loop {
        std::thread::sleep(std::time::Duration::from_millis(500));
        if let Some(out) = generate() {
            break out;
        }
        assert!(std::time::Instant::now() < until, "the mesh did not serve again");
    };
    assert_eq!(tokens(&got), want);
    let again = child_pid(up.id(), "/decode-0.toml").expect("the decode node is back");
    assert_ne!(again, decode);
    assert!(up.try_wait().unwrap().is_none(), "up stopped when a node died");
    let _ = std::process::Command::new("kill").args(["-TERM", &up.id().to_string()]).status();
    let _ = up.wait();
}
