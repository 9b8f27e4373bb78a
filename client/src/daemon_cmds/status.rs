//! `leanstream status` and `leanstream models`: what the daemon holds, as tables or JSON.

use std::collections::{BTreeMap, HashMap};

use leanstream::Client;
use leanstream::contract::{MemoryReport, ModelInfo, ModelParts};

use crate::table::{Align, bytes, render};

/// The memory report as text: the budget line, then one table each for models (with how long
/// each took to load, from `counters`), loaded models by placement (weights resident, streamed
/// whole through the ring, streamed by neuron) and part, sessions and clients (a table with no
/// rows says `(none)`).
pub fn format_status(report: &MemoryReport, counters: &HashMap<String, u64>) -> String {
    let percent = if report.budget_bytes == 0 {
        0.0
    } else {
        100.0 * report.used_bytes as f64 / report.budget_bytes as f64
    };
    let free = report.budget_bytes.saturating_sub(report.used_bytes);
    let mut out = format!(
        "budget {}, used {} ({percent:.1} %), free {}; process resident {}\n",
        bytes(report.budget_bytes),
        bytes(report.used_bytes),
        bytes(free),
        bytes(report.rss_bytes),
    );
    let mut section = |title: &str, headers: &[(&str, Align)], rows: Vec<Vec<String>>| {
        out.push('\n');
        out.push_str(title);
        out.push('\n');
        if rows.is_empty() {
            out.push_str("(none)\n");
        } else {
            out.push_str(&render(headers, &rows));
        }
    };
    section(
        "models",
        &[
            ("MODEL", Align::Left),
            ("MODE", Align::Left),
            ("RESIDENT", Align::Right),
            ("CACHE", Align::Right),
            ("FLOOR", Align::Right),
            ("WANTED", Align::Right),
            ("TOTAL", Align::Right),
            ("READ/TOKEN", Align::Right),
            ("IDLE", Align::Right),
            ("UNLOADS IN", Align::Right),
            ("LOADED IN", Align::Right),
        ],
        report
            .models
            .iter()
            .map(|m| {
                vec![
                    m.name.clone(),
                    m.mode.clone(),
                    bytes(m.resident_bytes),
                    bytes(m.cache_bytes),
                    bytes(m.cache_floor_bytes),
                    bytes(m.cache_wanted_bytes),
                    bytes(m.resident_bytes.saturating_add(m.cache_bytes)),
                    bytes(m.streamed_bytes_per_token),
                    format!("{}s", m.idle_seconds),
                    if m.unload_in_seconds < 0 {
                        "-".to_string()
                    } else {
                        format!("{}s", m.unload_in_seconds)
                    },
                    match counters.get(&format!("model_load_ms.{}", m.name)) {
                        Some(ms) => format!("{:.2}s", *ms as f64 / 1000.0),
                        None => "-".to_string(),
                    },
                ]
            })
            .collect(),
    );
    section(
        "loaded models by placement and part",
        &[
            ("MODEL", Align::Left),
            ("WEIGHTS", Align::Right),
            ("STREAMED WHOLE", Align::Right),
            ("STREAMED SPARSE", Align::Right),
            ("TOKENIZER", Align::Right),
            ("TABLES", Align::Right),
            ("RING", Align::Right),
        ],
        report
            .models
            .iter()
            .filter(|m| m.parts != ModelParts::default())
            .map(|m| {
                let p = &m.parts;
                vec![
                    m.name.clone(),
                    bytes(p.weights),
                    bytes(p.streamed_whole),
                    bytes(p.streamed_sparse),
                    bytes(p.tokenizer),
                    bytes(p.tables),
                    bytes(p.ring),
                ]
            })
            .collect(),
    );
    section(
        "sessions",
        &[
            ("SESSION", Align::Left),
            ("MODEL", Align::Left),
            ("CLIENT", Align::Left),
            ("MEMORY", Align::Right),
        ],
        report
            .sessions
            .iter()
            .map(|s| {
                let path = s.path.as_str();
                // Show `session/3` rather than the full object path.
                let short = path
                    .rsplit_once('/')
                    .map(|(_, n)| format!("session/{n}"))
                    .unwrap_or_else(|| path.to_owned());
                vec![short, s.model.clone(), s.client.clone(), bytes(s.bytes)]
            })
            .collect(),
    );
    section(
        "clients",
        &[
            ("CLIENT", Align::Left),
            ("SESSIONS", Align::Right),
            ("MEMORY", Align::Right),
        ],
        report
            .clients
            .iter()
            .map(|c| vec![c.client.clone(), c.sessions.to_string(), bytes(c.bytes)])
            .collect(),
    );
    out
}

/// The model list as a table.
pub fn format_models(models: &[ModelInfo]) -> String {
    if models.is_empty() {
        return "(no models in the daemon's model directory)\n".to_owned();
    }
    render(
        &[
            ("NAME", Align::Left),
            ("FORMAT", Align::Left),
            ("ARCH", Align::Left),
            ("QUANTIZATION", Align::Left),
            ("SIZE", Align::Right),
            ("LOADED", Align::Left),
        ],
        &models
            .iter()
            .map(|m| {
                vec![
                    m.name.clone(),
                    m.format.clone(),
                    m.architecture.clone(),
                    m.quantization.clone(),
                    bytes(m.file_bytes),
                    if m.loaded { "yes" } else { "no" }.to_owned(),
                ]
            })
            .collect::<Vec<_>>(),
    )
}

/// The counters as a table, by name, with the mean time to first token of each class after
/// its counters.
pub fn format_counters(counters: &HashMap<String, u64>) -> String {
    let sorted: BTreeMap<&String, &u64> = counters.iter().collect();
    let mut rows = Vec::new();
    for (name, value) in sorted {
        rows.push(vec![name.clone(), value.to_string()]);
        if let Some(class) = name
            .strip_prefix("ttft_us.")
            .and_then(|n| n.strip_suffix(".sum"))
        {
            let count = counters.get(&format!("ttft_us.{class}.count"));
            if let Some(&count) = count.filter(|c| **c > 0) {
                let mean_ms = *value as f64 / count as f64 / 1000.0;
                rows.push(vec![
                    format!("(ttft {class} mean)"),
                    format!("{mean_ms:.1} ms"),
                ]);
            }
        }
    }
    render(&[("COUNTER", Align::Left), ("VALUE", Align::Right)], &rows)
}

pub async fn status(client: &Client, json: bool) -> anyhow::Result<()> {
    let report = client.memory().await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        // Only the load times come from the counters: a daemon without `Counters()` (an older
        // one) still gets its report, with `-` for them.
        let counters = client.counters().await.unwrap_or_default();
        print!("{}", format_status(&report, &counters));
    }
    Ok(())
}

pub async fn counters(client: &Client, json: bool) -> anyhow::Result<()> {
    let counters = client.counters().await?;
    if json {
        let sorted: BTreeMap<_, _> = counters.iter().collect();
        println!("{}", serde_json::to_string_pretty(&sorted)?);
    } else {
        print!("{}", format_counters(&counters));
    }
    Ok(())
}

pub async fn models(client: &Client, json: bool) -> anyhow::Result<()> {
    let models = client.list_models().await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&models)?);
    } else {
        print!("{}", format_models(&models));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use leanstream::contract::{ClientMemory, ModelMemory, SessionMemory};
    use zbus::zvariant::OwnedObjectPath;

    use super::*;

    fn report() -> MemoryReport {
        let path = |n: u32| {
            OwnedObjectPath::try_from(format!("/io/github/leanstream/LeanStream1/session/{n}"))
                .expect("valid path")
        };
        MemoryReport {
            budget_bytes: 512 << 20,
            used_bytes: 200 << 20,
            rss_bytes: 221 << 20,
            models: vec![
                ModelMemory {
                    name: "smollm2".into(),
                    resident_bytes: 100 << 20,
                    cache_bytes: 60 << 20,
                    cache_floor_bytes: 2 << 20,
                    cache_wanted_bytes: 80 << 20,
                    mode: "leanstream".into(),
                    streamed_bytes_per_token: 0,
                    idle_seconds: 0,
                    unload_in_seconds: -1,
                    parts: ModelParts {
                        weights: 90 << 20,
                        tokenizer: 2 << 20,
                        tables: 1 << 19,
                        ring: 0,
                        streamed_whole: 0,
                        streamed_sparse: 0,
                    },
                },
                ModelMemory {
                    name: "smollm2-small".into(),
                    resident_bytes: 30 << 20,
                    cache_bytes: 0,
                    cache_floor_bytes: 0,
                    cache_wanted_bytes: 0,
                    mode: "dense+neuron".into(),
                    streamed_bytes_per_token: 21 << 20,
                    idle_seconds: 12,
                    unload_in_seconds: 288,
                    parts: ModelParts {
                        weights: 20 << 20,
                        tokenizer: 2 << 20,
                        tables: 1 << 19,
                        ring: 6 << 20,
                        streamed_whole: 18 << 20,
                        streamed_sparse: 40 << 20,
                    },
                },
            ],
            sessions: vec![
                SessionMemory {
                    path: path(1),
                    model: "smollm2".into(),
                    client: ":1.42".into(),
                    bytes: 30 << 20,
                },
                SessionMemory {
                    path: path(12),
                    model: "smollm2".into(),
                    client: ":1.7".into(),
                    bytes: 10 << 20,
                },
            ],
            clients: vec![
                ClientMemory {
                    client: ":1.42".into(),
                    sessions: 1,
                    bytes: 30 << 20,
                },
                ClientMemory {
                    client: ":1.7".into(),
                    sessions: 1,
                    bytes: 10 << 20,
                },
            ],
        }
    }

    #[test]
    fn status_tables_are_aligned() {
        let expected = "\
budget 512.0 MiB, used 200.0 MiB (39.1 %), free 312.0 MiB; process resident 221.0 MiB

models
MODEL          MODE           RESIDENT     CACHE    FLOOR    WANTED      TOTAL  READ/TOKEN  IDLE  UNLOADS IN  LOADED IN
smollm2        leanstream    100.0 MiB  60.0 MiB  2.0 MiB  80.0 MiB  160.0 MiB         0 B    0s           -      1.23s
smollm2-small  dense+neuron   30.0 MiB       0 B      0 B       0 B   30.0 MiB    21.0 MiB   12s        288s          -

loaded models by placement and part
MODEL           WEIGHTS  STREAMED WHOLE  STREAMED SPARSE  TOKENIZER     TABLES     RING
smollm2        90.0 MiB             0 B              0 B    2.0 MiB  512.0 KiB      0 B
smollm2-small  20.0 MiB        18.0 MiB         40.0 MiB    2.0 MiB  512.0 KiB  6.0 MiB

sessions
SESSION     MODEL    CLIENT    MEMORY
session/1   smollm2  :1.42   30.0 MiB
session/12  smollm2  :1.7    10.0 MiB

clients
CLIENT  SESSIONS    MEMORY
:1.42          1  30.0 MiB
:1.7           1  10.0 MiB
";
        let counters = HashMap::from([("model_load_ms.smollm2".to_string(), 1234)]);
        assert_eq!(format_status(&report(), &counters), expected);
    }

    #[test]
    fn counters_are_sorted_with_the_mean_time_to_first_token() {
        let counters = HashMap::from([
            ("tokens.generated".to_string(), 42),
            ("ttft_us.interactive.count".to_string(), 4),
            ("ttft_us.interactive.sum".to_string(), 100_000),
            ("refusals.Busy".to_string(), 1),
        ]);
        let expected = "\
COUNTER                      VALUE
refusals.Busy                    1
tokens.generated                42
ttft_us.interactive.count        4
ttft_us.interactive.sum     100000
(ttft interactive mean)    25.0 ms
";
        assert_eq!(format_counters(&counters), expected);
    }

    #[test]
    fn empty_report_says_none() {
        let empty = MemoryReport {
            budget_bytes: 0,
            used_bytes: 0,
            rss_bytes: 0,
            models: vec![],
            sessions: vec![],
            clients: vec![],
        };
        let text = format_status(&empty, &HashMap::new());
        assert!(
            text.starts_with("budget 0 B, used 0 B (0.0 %), free 0 B; process resident 0 B\n"),
            "{text}"
        );
        // models, models by placement and part, sessions, clients
        assert_eq!(text.matches("(none)").count(), 4, "{text}");
    }

    #[test]
    fn status_json_has_the_report_fields() {
        let value = serde_json::to_value(report()).expect("serialisable");
        assert_eq!(value["budget_bytes"], 512u64 << 20);
        assert_eq!(
            value["sessions"][0]["path"],
            "/io/github/leanstream/LeanStream1/session/1"
        );
        assert_eq!(value["clients"][1]["client"], ":1.7");
        assert_eq!(value["models"][1]["parts"]["ring"], 6u64 << 20);
        assert_eq!(value["models"][1]["parts"]["streamed_whole"], 18u64 << 20);
        assert_eq!(value["models"][1]["parts"]["streamed_sparse"], 40u64 << 20);
        assert_eq!(value["models"][0]["parts"]["streamed_sparse"], 0);
    }

    #[test]
    fn models_table() {
        let models = vec![
            ModelInfo {
                name: "smollm2".into(),
                format: "lsm".into(),
                architecture: "llama".into(),
                quantization: "q4_1 55%, q8_0 45%".into(),
                file_bytes: 90 << 20,
                loaded: true,
            },
            ModelInfo {
                name: "SmolLM2-135M-Instruct.Q4_1".into(),
                format: "gguf".into(),
                architecture: "llama".into(),
                quantization: "Q4_1 (q4_1 100%)".into(),
                file_bytes: 95_000_000,
                loaded: false,
            },
        ];
        assert_eq!(
            format_models(&models),
            "\
NAME                        FORMAT  ARCH   QUANTIZATION            SIZE  LOADED
smollm2                     lsm     llama  q4_1 55%, q8_0 45%  90.0 MiB  yes
SmolLM2-135M-Instruct.Q4_1  gguf    llama  Q4_1 (q4_1 100%)    90.6 MiB  no
"
        );
    }
}
