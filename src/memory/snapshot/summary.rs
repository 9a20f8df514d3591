//! Owns what filled memory, from a capture: bytes by category, the largest allocations, the
//! timeline and the paragraph.
//! Keeps: pure; every live byte falls in exactly one category.
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};

use super::{phase_of, Capture, Rec, ALLOC, FREE};
use crate::error::Phase;
use crate::memory::human_bytes;

/// The categories, in the order the text and the pictures use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    Parameters,
    Gradients,
    OptimizerState,
    /// Made in the forward (or evaluation) and still alive: saved for backward; in backward,
    /// the activations' gradients on their way down.
    Activations,
    /// Made under a `logits` or `loss` scope (the GPT's head and cross-entropy).
    LossLogits,
    /// Made since the failing op began (it was asking for more).
    FailingOp,
    /// Held by the caching allocator beyond live tensors (CUDA; 0 on the CPU).
    AllocatorReserve,
    Other,
}

pub const CATEGORIES: [Category; 8] = [
    Category::Parameters,
    Category::Gradients,
    Category::OptimizerState,
    Category::Activations,
    Category::LossLogits,
    Category::FailingOp,
    Category::AllocatorReserve,
    Category::Other,
];

impl Category {
    pub fn label(self) -> &'static str {
        match self {
            Category::Parameters => "parameters",
            Category::Gradients => "gradients",
            Category::OptimizerState => "optimizer state",
            Category::Activations => "activations",
            Category::LossLogits => "loss/logits",
            Category::FailingOp => "the failing op's temporaries",
            Category::AllocatorReserve => "allocator reserve",
            Category::Other => "other",
        }
    }
}

/// Data pointers of the tensors whose role the runtime knows.
#[derive(Debug, Clone, Default)]
pub struct Roles {
    pub parameters: Vec<u64>,
    pub gradients: Vec<u64>,
    pub optimizer_state: Vec<u64>,
}

/// Where and how the OOM happened, as the runtime saw it (and, filled in, in summary.json).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Context {
    pub step: Option<u64>,
    pub phase: Option<Phase>,
    pub micro_batch_index: Option<usize>,
    pub micro_batch_size: Option<usize>,
    /// None: a dump at the end, not an OOM.
    pub request_bytes: Option<u64>,
    pub limit_bytes: Option<u64>,
    pub free_bytes: Option<u64>,
    pub reserved_bytes: Option<u64>,
    /// CUDA only.
    pub largest_free_block_bytes: Option<u64>,
    pub device: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Allocation {
    pub bytes: u64,
    pub category: Category,
    pub op: String,
    pub top_op: String,
    pub module: String,
    pub phase: Option<Phase>,
    pub step: Option<u64>,
    pub micro_batch: Option<u64>,
}

/// Live bytes by category over the failing attempt's events (memory_viz's active memory
/// timeline): `bytes[i][c]` after event `events[i]`, categories as `categories`.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Timeline {
    pub categories: Vec<Category>,
    pub events: Vec<u64>,
    pub bytes: Vec<Vec<u64>>,
}

/// `summary.json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Breakdown {
    /// `oom`, or `end` for `always`'s dump at the end.
    pub kind: String,
    #[serde(flatten)]
    pub at: Context,
    pub live_bytes: u64,
    /// Every live byte (and the allocator's reserve): they sum to `reserved_bytes` (or
    /// `live_bytes` on the CPU).
    pub categories: BTreeMap<Category, u64>,
    pub activations_by_module: BTreeMap<String, u64>,
    /// Activations made in an earlier step and still alive: a graph or tensor kept across
    /// steps grows this.
    pub activations_from_earlier_steps_bytes: u64,
    pub failing_op: Option<String>,
    pub failing_top_op: Option<String>,
    /// A Python model's source lines at the failure, innermost first (`file:line in name`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub python_stack: Vec<String>,
    /// The planner's prediction by the same categories, where it has a formula.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<BTreeMap<Category, u64>>,
    pub largest: Vec<Allocation>,
    pub timeline: Timeline,
    pub live_allocations: usize,
    pub events_recorded: u64,
    pub events_kept: usize,
    pub text: String,
}

const LOSS_BACKWARD: [&str; 3] = ["NllLossBackward", "LogSoftmaxBackward", "CrossEntropyLossBackward"];

fn is_loss_scope(module: &str) -> bool {
    module.starts_with("logits") || module.starts_with("loss")
}

/// The category of an allocation by its context alone (no addresses).
fn by_context(r: &Rec, op_seq: Option<u64>, names: &dyn Fn(i32) -> String) -> Category {
    if op_seq.is_some_and(|s| r.seq >= s) {
        return Category::FailingOp;
    }
    match phase_of(r.phase) {
        Some(Phase::Forward | Phase::Eval | Phase::Backward) if is_loss_scope(&names(r.module)) => Category::LossLogits,
        // The loss's own backward (the logits' gradient), named by the autograd node.
        Some(Phase::Backward) if LOSS_BACKWARD.iter().any(|n| names(r.top_op).contains(n)) => Category::LossLogits,
        Some(Phase::Forward | Phase::Eval | Phase::Backward) => Category::Activations,
        _ => Category::Other,
    }
}

/// Assigns each role's pointers to the live allocation that holds them, keyed by (address,
/// number): an earlier allocation at a reused address is not a parameter.
fn role_of(live: &[Rec], roles: &Roles) -> HashMap<(u64, u64), Category> {
    let mut sorted: Vec<(u64, u64, u64)> = live
        .iter()
        .map(|r| (r.addr, r.addr + r.size.max(0) as u64, r.seq))
        .collect();
    sorted.sort_unstable();
    let mut out = HashMap::new();
    for (cat, ptrs) in [
        (Category::Parameters, &roles.parameters),
        (Category::Gradients, &roles.gradients),
        (Category::OptimizerState, &roles.optimizer_state),
    ] {
        for &p in ptrs {
            let i = sorted.partition_point(|&(a, _, _)| a <= p);
            if i > 0 && p < sorted[i - 1].1.max(sorted[i - 1].0 + 1) {
                out.entry((sorted[i - 1].0, sorted[i - 1].2)).or_insert(cat);
            }
        }
    }
    out
}

pub fn breakdown(
    cap: &Capture,
    roles: &Roles,
    ctx: &Context,
    names: &dyn Fn(i32) -> String,
    plan: Option<BTreeMap<Category, u64>>,
) -> Breakdown {
    let oom = ctx.request_bytes.is_some();
    let op_seq = (oom && cap.info.op_seq < cap.info.seq).then_some(cap.info.op_seq);
    let roles_at = role_of(&cap.live, roles);
    let category = |r: &Rec| {
        roles_at
            .get(&(r.addr, r.seq))
            .copied()
            .unwrap_or_else(|| by_context(r, op_seq, names))
    };
    let mut categories: BTreeMap<Category, u64> = CATEGORIES.iter().map(|&c| (c, 0)).collect();
    let mut by_module = BTreeMap::<String, u64>::new();
    let mut earlier = 0;
    let live_bytes: u64 = cap.live.iter().map(|r| r.size.max(0) as u64).sum();
    for r in &cap.live {
        let (c, b) = (category(r), r.size.max(0) as u64);
        *categories.entry(c).or_default() += b;
        if c == Category::Activations {
            let m = names(r.module);
            let key = if m.is_empty() {
                format!("({})", phase_name(phase_of(r.phase)))
            } else {
                m
            };
            *by_module.entry(key).or_default() += b;
            if ctx.step.is_some_and(|s| r.step >= 0 && (r.step as u64) < s) {
                earlier += b;
            }
        }
    }
    let reserve = ctx.reserved_bytes.map_or(0, |r| r.saturating_sub(live_bytes));
    *categories.entry(Category::AllocatorReserve).or_default() += reserve;
    let mut largest: Vec<&Rec> = cap.live.iter().collect();
    largest.sort_by_key(|r| std::cmp::Reverse(r.size));
    let largest = largest
        .into_iter()
        .take(12)
        .map(|r| allocation(r, category(r), names))
        .collect();
    let failing = &cap.info.failing;
    let at = Context {
        phase: ctx.phase.or(phase_of(failing.phase)).filter(|_| oom),
        free_bytes: ctx
            .free_bytes
            .or_else(|| ctx.limit_bytes.map(|l| l.saturating_sub(live_bytes))),
        reserved_bytes: ctx.reserved_bytes.or(Some(live_bytes)),
        ..ctx.clone()
    };
    let mut b = Breakdown {
        kind: if oom { "oom" } else { "end" }.into(),
        at,
        live_bytes,
        categories,
        activations_by_module: by_module,
        activations_from_earlier_steps_bytes: earlier,
        failing_op: (oom && failing.op > 0).then(|| names(failing.op)),
        failing_top_op: (oom && failing.top_op > 0).then(|| names(failing.top_op)),
        python_stack: if oom { cap.python.clone() } else { Vec::new() },
        plan,
        largest,
        timeline: timeline(cap, &category),
        live_allocations: cap.live.len(),
        events_recorded: cap.info.events_written,
        events_kept: cap.events.len(),
        text: String::new(),
    };
    b.text = text(&b);
    b
}

fn allocation(r: &Rec, category: Category, names: &dyn Fn(i32) -> String) -> Allocation {
    Allocation {
        bytes: r.size.max(0) as u64,
        category,
        op: names(r.op),
        top_op: names(r.top_op),
        module: names(r.module),
        phase: phase_of(r.phase),
        step: u64::try_from(r.step).ok(),
        micro_batch: u64::try_from(r.micro_batch).ok(),
    }
}

fn phase_name(p: Option<Phase>) -> String {
    p.map_or("outside a step".into(), |p| {
        serde_json::to_value(p)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default()
    })
}

/// At most this many points per timeline.
const POINTS: usize = 240;

/// Live bytes by category after each of the failing attempt's events: the live set at the
/// end, walked back to the attempt's start, then forward again.
fn timeline(cap: &Capture, category: &dyn Fn(&Rec) -> Category) -> Timeline {
    let first_kept = cap.info.events_written - cap.events.len() as u64;
    let start = cap
        .info
        .attempt_event
        .saturating_sub(first_kept)
        .min(cap.events.len() as u64) as usize;
    let events = &cap.events[start..];
    let mut live: HashMap<(u64, u64), Rec> = cap.live.iter().map(|r| ((r.addr, r.seq), *r)).collect();
    for e in events.iter().rev() {
        match e.action {
            ALLOC => {
                live.remove(&(e.addr, e.seq));
            }
            FREE => {
                live.insert((e.addr, e.seq), Rec { action: ALLOC, ..*e });
            }
            _ => {}
        }
    }
    let index = |c: Category| CATEGORIES.iter().position(|&x| x == c).unwrap_or(0); // every category is listed
    let mut now = vec![0u64; CATEGORIES.len()];
    for r in live.values() {
        now[index(category(r))] += r.size.max(0) as u64;
    }
    let every = events.len().div_ceil(POINTS).max(1);
    let mut t = Timeline {
        categories: CATEGORIES.to_vec(),
        events: vec![0],
        bytes: vec![now.clone()],
    };
    for (i, e) in events.iter().enumerate() {
        let b = e.size.max(0) as u64;
        match e.action {
            ALLOC => now[index(category(e))] += b,
            FREE => {
                let c = index(category(e));
                now[c] = now[c].saturating_sub(b);
            }
            _ => {}
        }
        if (i + 1) % every == 0 || i + 1 == events.len() {
            t.events.push(i as u64 + 1);
            t.bytes.push(now.clone());
        }
    }
    t
}

fn share(part: u64, whole: u64) -> String {
    format!(
        "{} ({:.0}%)",
        human_bytes(part),
        100.0 * part as f64 / whole.max(1) as f64
    )
}

/// The paragraph: where, what was asked against what was free, then the categories largest
/// first (activations by module), the failing op and, where there is one, the plan.
pub fn text(b: &Breakdown) -> String {
    let mut where_ = Vec::new();
    if let Some(s) = b.at.step {
        where_.push(format!("step {s}"));
    }
    if let Some(p) = b.at.phase {
        where_.push(phase_name(Some(p)));
    }
    if let Some(i) = b.at.micro_batch_index {
        where_.push(format!("micro-batch {i}"));
    }
    if let Some(m) = b.at.micro_batch_size {
        where_.push(format!("micro-batch size {m}"));
    }
    let head = match b.at.request_bytes {
        Some(r) => format!(
            "Out of memory at {}: asked {} with {} live{}{}",
            if where_.is_empty() {
                "start".into()
            } else {
                where_.join(", ")
            },
            human_bytes(r),
            human_bytes(b.live_bytes),
            b.at.limit_bytes
                .map(|l| format!(" of a {} limit", human_bytes(l)))
                .unwrap_or_default(),
            b.at.free_bytes
                .map(|f| format!(
                    " ({} free{})",
                    human_bytes(f),
                    b.at.largest_free_block_bytes
                        .map(|l| format!(", largest free block {}", human_bytes(l)))
                        .unwrap_or_default()
                ))
                .unwrap_or_default(),
        ),
        None => format!(
            "Memory at the end ({}): {} live",
            where_.join(", "),
            human_bytes(b.live_bytes)
        ),
    };
    let whole = b.at.reserved_bytes.unwrap_or(b.live_bytes).max(b.live_bytes);
    let mut cats: Vec<(&Category, &u64)> = b.categories.iter().filter(|(_, &v)| v > 0).collect();
    cats.sort_by_key(|(_, &v)| std::cmp::Reverse(v));
    let parts: Vec<String> = cats
        .iter()
        .map(|(&c, &v)| {
            let mut s = format!("{} {}", c.label(), share(v, whole));
            if c == Category::Activations {
                let mut m: Vec<(&String, &u64)> = b.activations_by_module.iter().collect();
                m.sort_by_key(|(_, &v)| std::cmp::Reverse(v));
                let top: Vec<String> = m
                    .iter()
                    .take(3)
                    .map(|(k, &v)| format!("{k} {}", human_bytes(v)))
                    .collect();
                if !top.is_empty() {
                    s += &format!(" (of which {})", top.join(", "));
                }
                if b.activations_from_earlier_steps_bytes > 0 {
                    s += &format!(
                        ", {} of it kept from earlier steps",
                        human_bytes(b.activations_from_earlier_steps_bytes)
                    );
                }
            }
            s
        })
        .collect();
    let mut out = format!(
        "{head}: {}.",
        if parts.is_empty() {
            "nothing recorded".into()
        } else {
            parts.join(", ")
        }
    );
    if let Some(op) = &b.failing_op {
        let top = b
            .failing_top_op
            .as_ref()
            .filter(|t| *t != op)
            .map(|t| format!(" in {t}"))
            .unwrap_or_default();
        out += &format!(" The failing op: {op}{top}.");
    }
    // The user's own line first (an absolute path: packages' paths are cut to the package),
    // then the innermost frame when that is a package's.
    if let Some(inner) = b.python_stack.first() {
        match b.python_stack.iter().find(|f| f.starts_with('/')) {
            Some(own) if own != inner => out += &format!(" In Python: {own} (innermost {inner})."),
            _ => out += &format!(" In Python: {inner}."),
        }
    }
    if let Some(a) = b.largest.first() {
        let module = if a.module.is_empty() {
            String::new()
        } else {
            format!(" in {}", a.module)
        };
        out += &format!(
            " Largest allocation: {} ({}, {}{module}).",
            human_bytes(a.bytes),
            a.category.label(),
            if a.op.is_empty() { "no op" } else { &a.op }
        );
    }
    if let Some(p) = &b.plan {
        let planned: Vec<String> = cats
            .iter()
            .filter_map(|(c, _)| p.get(c).map(|v| format!("{} {}", c.label(), human_bytes(*v))))
            .collect();
        if !planned.is_empty() {
            out += &format!(" The planner predicted {}.", planned.join(", "));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::snapshot::Info;

    fn rec(addr: u64, size: i64, seq: u64, phase: Option<Phase>, module: i32, step: i64) -> Rec {
        let phase = phase.map_or(0, |p| super::super::phase_code(Some(p)));
        Rec {
            addr,
            size,
            seq,
            step,
            phase,
            module,
            action: ALLOC,
            ..Default::default()
        }
    }

    #[test]
    fn every_byte_has_one_category() {
        let names = |id: i32| ["", "block.0", "logits", "aten::mm"][id as usize].to_string();
        let live = vec![
            rec(1000, 100, 0, Some(Phase::Init), 0, -1),    // a parameter
            rec(2000, 100, 1, Some(Phase::Init), 0, -1),    // optimizer state
            rec(3000, 50, 2, Some(Phase::Forward), 1, 2),   // an activation kept from step 2
            rec(4000, 70, 5, Some(Phase::Forward), 1, 3),   // block.0's activation
            rec(5000, 300, 6, Some(Phase::Forward), 2, 3),  // the logits
            rec(6000, 100, 7, Some(Phase::Backward), 0, 3), // a gradient (by address)
            rec(7000, 40, 9, Some(Phase::Backward), 0, 3),  // the failing op's temporary
            rec(8000, 30, 3, Some(Phase::Data), 0, 3),      // the batch
        ];
        let mut events: Vec<Rec> = live.clone();
        events.push(Rec {
            action: FREE,
            ..rec(9000, 500, 8, Some(Phase::Forward), 1, 3)
        });
        events.insert(6, rec(9000, 500, 8, Some(Phase::Forward), 1, 3));
        let cap = Capture {
            info: Info {
                request: 64,
                live: 790,
                budget: 800,
                seq: 10,
                op_seq: 9,
                attempt_seq: 3,
                events_written: 10,
                attempt_event: 3,
                failing: Rec {
                    op: 3,
                    phase: 3,
                    ..Default::default()
                },
            },
            live,
            events,
            python: vec![
                "torch/nn/modules/linear.py:134 in forward".into(),
                "/home/me/model.py:12 in forward".into(),
            ],
        };
        let roles = Roles {
            parameters: vec![1000],
            gradients: vec![6010],
            optimizer_state: vec![2000],
        };
        let ctx = Context {
            step: Some(3),
            request_bytes: Some(64),
            limit_bytes: Some(800),
            device: "cpu".into(),
            micro_batch_size: Some(4),
            ..Default::default()
        };
        let b = breakdown(&cap, &roles, &ctx, &names, None);
        let c = |k| b.categories[&k];
        assert_eq!(c(Category::Parameters), 100);
        assert_eq!(c(Category::OptimizerState), 100);
        assert_eq!(c(Category::Gradients), 100);
        assert_eq!(c(Category::Activations), 120);
        assert_eq!(c(Category::LossLogits), 300);
        assert_eq!(c(Category::FailingOp), 40);
        assert_eq!(c(Category::Other), 30);
        assert_eq!(b.categories.values().sum::<u64>(), b.live_bytes);
        assert_eq!(b.live_bytes, 790);
        assert_eq!(b.activations_from_earlier_steps_bytes, 50);
        assert_eq!(b.activations_by_module["block.0"], 120);
        assert_eq!(b.at.free_bytes, Some(10));
        assert_eq!(b.largest[0].category, Category::LossLogits);
        assert_eq!(b.failing_op.as_deref(), Some("aten::mm"));
        // The timeline starts at the attempt (3 allocations live) and ends at the live set.
        let total = |i: usize| b.timeline.bytes[i].iter().sum::<u64>();
        assert_eq!(total(0), 250);
        assert_eq!(total(b.timeline.bytes.len() - 1), 790);
        assert!(
            b.timeline.bytes.iter().any(|v| v.iter().sum::<u64>() >= 1000),
            "the freed 500 bytes show: {:?}",
            b.timeline
        );
        assert!(b.text.starts_with("Out of memory at step 3, backward, micro-batch size 4: asked 64 B with 790 B live of a 800 B limit (10 B free): \
            loss/logits 300 B (38%)"), "{}", b.text);
        assert!(
            b.text
                .contains("activations 120 B (15%) (of which block.0 120 B), 50 B of it kept from earlier steps"),
            "{}",
            b.text
        );
        assert!(
            b.text.contains(
                "In Python: /home/me/model.py:12 in forward (innermost torch/nn/modules/linear.py:134 in forward)."
            ),
            "{}",
            b.text
        );
    }
}
