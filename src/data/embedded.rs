//! Owns the embedded default corpus: a deterministic synthetic language, no download.
//! Keeps: a fixed seed, so the same size gives the same bytes on every machine and every run.
use crate::rng::splitmix64;

const ADJ: &[&str] = &[
    "red", "small", "quiet", "old", "clever", "lazy", "bright", "tiny", "brave", "green",
];
const NOUN: &[&str] = &[
    "cat", "dog", "fox", "bird", "robot", "farmer", "teacher", "river", "engine", "child",
];
const VERB: &[&str] = &["see", "chase", "follow", "help", "watch", "find", "paint", "carry"];
const ADV: &[&str] = &["slowly", "quickly", "again", "today", "at night", "with care"];

struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 = splitmix64(self.0);
        (self.0 % n as u64) as usize
    }
    fn pick<'a>(&mut self, xs: &[&'a str]) -> &'a str {
        xs[self.below(xs.len())]
    }
}

fn noun_phrase(r: &mut Rng, out: &mut String) -> bool {
    let plural = r.below(3) == 0;
    out.push_str(if plural { "the " } else { ["the ", "a "][r.below(2)] });
    if r.below(2) == 0 {
        out.push_str(r.pick(ADJ));
        out.push(' ');
    }
    let noun = r.pick(NOUN);
    out.push_str(noun);
    if plural {
        out.push_str(if noun.ends_with('x') {
            "es"
        } else if noun == "child" {
            "ren"
        } else {
            "s"
        });
    }
    plural
}

fn sentence(r: &mut Rng, out: &mut String) {
    let plural = noun_phrase(r, out);
    out.push(' ');
    let verb = r.pick(VERB);
    out.push_str(verb);
    if !plural {
        out.push_str(if verb.ends_with("ch") || verb.ends_with("sh") {
            "es"
        } else if verb.ends_with('y') {
            ""
        } else {
            "s"
        });
        if verb.ends_with('y') {
            out.pop();
            out.push_str("ies");
        }
    }
    out.push(' ');
    noun_phrase(r, out);
    if r.below(2) == 0 {
        out.push(' ');
        out.push_str(r.pick(ADV));
    }
    out.push_str(".\n");
}

/// `bytes` bytes of the corpus; the same bytes on every machine.
pub fn corpus(bytes: usize) -> Vec<u8> {
    let mut r = Rng(0x00_0D_6A_4D);
    let mut text = String::with_capacity(bytes + 128);
    while text.len() < bytes {
        match r.below(10) {
            0..=5 => sentence(&mut r, &mut text),
            6..=7 => {
                let (a, b) = (r.below(50), r.below(50));
                text.push_str(&format!("{a} + {b} = {}.\n", a + b));
            }
            _ => {
                let start = r.below(90);
                let run: Vec<String> = (start..start + 3 + r.below(6)).map(|n| n.to_string()).collect();
                text.push_str(&format!("count {}.\n", run.join(" ")));
            }
        }
    }
    let mut out = text.into_bytes();
    out.truncate(bytes);
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn deterministic_and_readable() {
        let a = super::corpus(10_000);
        assert_eq!(a, super::corpus(10_000));
        assert_eq!(a.len(), 10_000);
        let text = String::from_utf8_lossy(&a);
        assert!(text.contains(" = ") && text.contains("count ") && text.contains(".\n"));
    }
}
