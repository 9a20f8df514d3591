//! Owns writing a CPU capture in PyTorch's memory snapshot format.
//! Keeps: the output loads in `torch.cuda._memory_viz` and memory_viz as a CUDA snapshot does.
use serde::Serialize;

use super::{phase_of, Capture, Rec, ALLOC, FREE, OOM};

#[derive(Serialize)]
struct Frame {
    name: String,
    filename: String,
    line: i64,
}

#[derive(Serialize)]
struct Block {
    address: u64,
    size: u64,
    requested_size: u64,
    state: &'static str,
    frames: Vec<Frame>,
}

#[derive(Serialize)]
struct Segment {
    device: i64,
    address: u64,
    total_size: u64,
    allocated_size: u64,
    active_size: u64,
    requested_size: u64,
    stream: i64,
    segment_type: &'static str,
    is_expandable: bool,
    blocks: Vec<Block>,
}

#[derive(Serialize)]
struct TraceEntry {
    action: &'static str,
    addr: u64,
    size: u64,
    stream: i64,
    time_us: i64,
    #[serde(skip_serializing_if = "Option::is_none")]
    device_free: Option<u64>,
    frames: Vec<Frame>,
}

#[derive(Serialize)]
struct Settings {
    backend: &'static str,
    budget_bytes: i64,
    max_events: u64,
}

#[derive(Serialize)]
struct Snapshot {
    segments: Vec<Segment>,
    device_traces: Vec<Vec<TraceEntry>>,
    allocator_settings: Settings,
}

fn frames(r: &Rec, names: &dyn Fn(i32) -> String) -> Vec<Frame> {
    let phase = phase_of(r.phase)
        .map(|p| format!("{p:?}").to_lowercase())
        .unwrap_or_default();
    let mb = if r.micro_batch >= 0 {
        format!(" micro-batch {}", r.micro_batch)
    } else {
        String::new()
    };
    let module = names(r.module);
    let context = format!(
        "oomguard {phase}{mb}{}",
        if module.is_empty() {
            String::new()
        } else {
            format!(" {module}")
        }
    );
    let mut out = vec![Frame {
        name: names(r.op),
        filename: context.clone(),
        line: r.step,
    }];
    if r.top_op != r.op && r.top_op > 0 {
        out.push(Frame {
            name: names(r.top_op),
            filename: context,
            line: r.step,
        });
    }
    out
}

/// The pickled snapshot (protocol 3).
pub fn pickled(
    cap: &Capture,
    names: &dyn Fn(i32) -> String,
    max_events: usize,
) -> Result<Vec<u8>, serde_pickle::Error> {
    let mut live: Vec<&Rec> = cap.live.iter().collect();
    live.sort_by_key(|r| r.addr);
    let segments = live
        .into_iter()
        .map(|r| {
            let size = r.size.max(0) as u64;
            Segment {
                device: 0,
                address: r.addr,
                total_size: size,
                allocated_size: size,
                active_size: size,
                requested_size: size,
                stream: 0,
                segment_type: if size >= 1 << 20 { "large" } else { "small" },
                is_expandable: false,
                blocks: vec![Block {
                    address: r.addr,
                    size,
                    requested_size: size,
                    state: "active_allocated",
                    frames: frames(r, names),
                }],
            }
        })
        .collect();
    let mut trace = Vec::with_capacity(cap.events.len() * 3 / 2);
    for e in &cap.events {
        let entry = |action| TraceEntry {
            action,
            addr: e.addr,
            size: e.size.max(0) as u64,
            stream: 0,
            time_us: e.time_us,
            device_free: None,
            frames: frames(e, names),
        };
        match e.action {
            ALLOC => trace.push(entry("alloc")),
            FREE => {
                trace.push(entry("free_requested"));
                trace.push(entry("free_completed"));
            }
            OOM => trace.push(TraceEntry {
                addr: 0,
                device_free: Some(e.addr),
                ..entry("oom")
            }),
            _ => {}
        }
    }
    let snapshot = Snapshot {
        segments,
        device_traces: vec![trace],
        allocator_settings: Settings {
            backend: "oomguard counting CPU allocator",
            budget_bytes: cap.info.budget,
            max_events: max_events as u64,
        },
    };
    serde_pickle::to_vec(&snapshot, serde_pickle::SerOptions::new())
}
