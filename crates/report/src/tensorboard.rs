//! Owns TensorBoard event files (`log.tensorboard`): scalars only, in TFRecord framing.
//! Keeps: each record is length, masked CRC-32C, Event, masked CRC-32C, as TensorBoard reads it.
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Appends events to one file; every record goes out in one write (no user-space buffer),
/// so a killed run loses nothing it logged and TensorBoard reads it live.
pub struct EventWriter {
    file: File,
    path: PathBuf,
}

impl EventWriter {
    /// A new file in `dir` (created), named like TensorFlow's:
    /// `events.out.tfevents.<unix seconds>.<host>.<pid>`.
    pub fn create(dir: &Path) -> std::io::Result<EventWriter> {
        std::fs::create_dir_all(dir)?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_default();
        let host = if host.is_empty() { "localhost".to_string() } else { host };
        let name = format!(
            "events.out.tfevents.{}.{host}.{}",
            now().trunc() as u64,
            std::process::id()
        );
        let path = dir.join(name);
        let file = std::fs::OpenOptions::new().create_new(true).write(true).open(&path)?;
        let mut w = EventWriter { file, path };
        let mut event = Vec::new();
        put_double(&mut event, 1, now());
        put_bytes(&mut event, 3, b"brain.Event:2");
        w.record(&event)?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One event at `step` holding every (tag, value); non-finite values are written too
    /// (TensorBoard shows NaN), since a diverging loss is worth seeing.
    pub fn scalars(&mut self, step: u64, values: &[(&str, f64)]) -> std::io::Result<()> {
        let mut summary = Vec::new();
        for (tag, v) in values {
            let mut value = Vec::new();
            put_bytes(&mut value, 1, tag.as_bytes());
            put_key(&mut value, 2, 5);
            value.extend_from_slice(&(*v as f32).to_le_bytes());
            put_bytes(&mut summary, 1, &value);
        }
        let mut event = Vec::new();
        put_double(&mut event, 1, now());
        put_key(&mut event, 2, 0);
        put_varint(&mut event, step);
        put_bytes(&mut event, 5, &summary);
        self.record(&event)
    }

    fn record(&mut self, data: &[u8]) -> std::io::Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        let mut rec = Vec::with_capacity(data.len() + 16);
        rec.extend_from_slice(&len);
        rec.extend_from_slice(&masked_crc(&len).to_le_bytes());
        rec.extend_from_slice(data);
        rec.extend_from_slice(&masked_crc(data).to_le_bytes());
        self.file.write_all(&rec)
    }
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn put_key(out: &mut Vec<u8>, field: u64, wire: u64) {
    put_varint(out, (field << 3) | wire);
}

fn put_double(out: &mut Vec<u8>, field: u64, v: f64) {
    put_key(out, field, 1);
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    put_key(out, field, 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// CRC-32C (Castagnoli), bitwise over a table built at compile time.
pub fn crc32c(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 { 0x82F6_3B78 ^ (c >> 1) } else { c >> 1 };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    };
    !data
        .iter()
        .fold(!0u32, |c, &b| TABLE[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8))
}

/// TFRecord's mask, so that CRCs of data holding CRCs stay strong.
pub fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// An event read back (tests, and anyone checking a file without TensorBoard).
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub wall_time: f64,
    pub step: u64,
    pub file_version: Option<String>,
    pub values: Vec<(String, f32)>,
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ReadError(String);

/// Reads an event file written by [`EventWriter`], checking every CRC.
pub fn read_events(bytes: &[u8]) -> Result<Vec<Event>, ReadError> {
    let mut events = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let err = |what: &str| ReadError(format!("record at byte {at}: {what}"));
        let head = bytes.get(at..at + 12).ok_or_else(|| err("truncated header"))?;
        if masked_crc(&head[..8]) != u32::from_le_bytes(head[8..12].try_into().unwrap_or_default()) {
            return Err(err("length CRC mismatch"));
        }
        let len = u64::from_le_bytes(head[..8].try_into().unwrap_or_default()) as usize;
        let data = bytes.get(at + 12..at + 12 + len).ok_or_else(|| err("truncated data"))?;
        let crc = bytes
            .get(at + 12 + len..at + 16 + len)
            .ok_or_else(|| err("truncated data CRC"))?;
        if masked_crc(data) != u32::from_le_bytes(crc.try_into().unwrap_or_default()) {
            return Err(err("data CRC mismatch"));
        }
        events.push(decode_event(data).ok_or_else(|| err("not an Event message"))?);
        at += 16 + len;
    }
    Ok(events)
}

/// A protobuf field: (number, wire type, varint or fixed value, bytes).
type Field<'a> = (u64, u8, u64, &'a [u8]);

fn fields(mut data: &[u8]) -> Option<Vec<Field<'_>>> {
    fn varint(d: &mut &[u8]) -> Option<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let (&b, rest) = d.split_first()?;
            *d = rest;
            v |= u64::from(b & 0x7f) << shift;
            if b < 0x80 {
                return Some(v);
            }
        }
        None
    }
    let mut out = Vec::new();
    while !data.is_empty() {
        let key = varint(&mut data)?;
        let (field, wire) = (key >> 3, (key & 7) as u8);
        let (n, slice): (u64, &[u8]) = match wire {
            0 => (varint(&mut data)?, &[]),
            1 | 5 => {
                let size = if wire == 1 { 8 } else { 4 };
                let (b, rest) = (data.get(..size)?, data.get(size..)?);
                data = rest;
                let mut buf = [0u8; 8];
                buf[..size].copy_from_slice(b);
                (u64::from_le_bytes(buf), b)
            }
            2 => {
                let len = varint(&mut data)? as usize;
                let (b, rest) = (data.get(..len)?, data.get(len..)?);
                data = rest;
                (len as u64, b)
            }
            _ => return None,
        };
        out.push((field, wire, n, slice));
    }
    Some(out)
}

fn decode_event(data: &[u8]) -> Option<Event> {
    let mut e = Event {
        wall_time: 0.0,
        step: 0,
        file_version: None,
        values: Vec::new(),
    };
    for (field, wire, n, bytes) in fields(data)? {
        match (field, wire) {
            (1, 1) => e.wall_time = f64::from_bits(n),
            (2, 0) => e.step = n,
            (3, 2) => e.file_version = Some(String::from_utf8_lossy(bytes).into_owned()),
            (5, 2) => {
                for (f, w, _, value) in fields(bytes)? {
                    if (f, w) != (1, 2) {
                        continue;
                    }
                    let (mut tag, mut v) = (String::new(), f32::NAN);
                    for (vf, vw, vn, vb) in fields(value)? {
                        match (vf, vw) {
                            (1, 2) => tag = String::from_utf8_lossy(vb).into_owned(),
                            (2, 5) => v = f32::from_bits(vn as u32),
                            _ => {}
                        }
                    }
                    e.values.push((tag, v));
                }
            }
            _ => {}
        }
    }
    Some(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_standard_check_value() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
    }

    #[test]
    fn written_events_read_back_with_their_tags_steps_and_values() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(&dir.path().join("tb")).unwrap();
        w.scalars(0, &[("train/loss", 5.5), ("memory/live_bytes", 52053200.0)])
            .unwrap();
        w.scalars(300, &[("eval/val_loss", 1.25)]).unwrap();
        let name = w.path().file_name().unwrap().to_string_lossy().into_owned();
        assert!(name.starts_with("events.out.tfevents."), "{name}");
        let bytes = std::fs::read(w.path()).unwrap();
        let ev = read_events(&bytes).unwrap();
        assert_eq!(ev.len(), 3);
        assert_eq!(ev[0].file_version.as_deref(), Some("brain.Event:2"));
        assert_eq!(ev[1].step, 0);
        assert_eq!(
            ev[1].values,
            [
                ("train/loss".to_string(), 5.5),
                ("memory/live_bytes".to_string(), 52053200.0)
            ]
        );
        assert_eq!((ev[2].step, ev[2].values[0].1), (300, 1.25));
        assert!(ev[2].wall_time > 1.6e9);
        let mut torn = bytes.clone();
        let last = torn.len() - 1;
        torn[last] ^= 1;
        assert!(read_events(&torn).unwrap_err().to_string().contains("CRC"));
    }
}
