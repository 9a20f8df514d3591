//! Owns lenient JSON-lines reading, for runs killed mid-write.
//! Keeps: a bad or torn line becomes a warning, never an error; every good line is read.
use serde::de::DeserializeOwned;
use std::io::{BufRead, BufReader};
use std::path::Path;

use crate::Error;

/// Reads `path`, calling `each` with every line that parses as `T`; the lines that do not
/// come back as warnings naming the file and the line number.
pub fn read<T: DeserializeOwned>(path: &Path, mut each: impl FnMut(T)) -> Result<Vec<String>, Error> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, "cannot open", e))?;
    let mut reader = BufReader::with_capacity(1 << 20, file);
    let (mut warnings, mut line, mut number) = (Vec::new(), Vec::new(), 0usize);
    loop {
        line.clear();
        let n = reader
            .read_until(b'\n', &mut line)
            .map_err(|e| Error::io(path, "cannot read", e))?;
        if n == 0 {
            break;
        }
        number += 1;
        let text = line.trim_ascii();
        if text.is_empty() {
            continue;
        }
        match serde_json::from_slice::<T>(text) {
            Ok(v) => each(v),
            Err(e) => {
                let torn = if line.last() != Some(&b'\n') {
                    " (a truncated last line?)"
                } else {
                    ""
                };
                warnings.push(format!(
                    "{}:{number}: skipped a line that is not a valid record{torn}: {e}",
                    path.display()
                ));
            }
        }
    }
    Ok(warnings)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize)]
    struct R {
        a: u64,
    }

    #[test]
    fn bad_and_torn_lines_become_warnings_with_their_numbers() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.jsonl");
        std::fs::write(&p, "{\"a\":1}\n\nnot json\n{\"a\":2,\"b\":3}\n{\"a\":").unwrap();
        let mut got = Vec::new();
        let w = read::<R>(&p, |r| got.push(r.a)).unwrap();
        assert_eq!(got, [1, 2]);
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(w[0].contains("m.jsonl:3:") && !w[0].contains("truncated"), "{}", w[0]);
        assert!(w[1].contains("m.jsonl:5:") && w[1].contains("truncated"), "{}", w[1]);
    }
}
