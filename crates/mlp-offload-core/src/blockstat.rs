//! What a block device itself saw: its counters in `/sys/dev/block/<major>:<minor>/stat`, and what
//! moved between two readings of them. The engines count what they asked for; these say how it reached
//! the device: how large its requests were after the block layer split or merged them, and how many
//! were queued at once (iostat's `rareq-sz`, `wareq-sz`, `%rrqm`, `aqu-sz`). File systems with no block
//! device of their own (FUSE, NFS, tmpfs) have none.

use serde::Serialize;

/// Bytes per sector in the kernel's block statistics, whatever the device's own sector size.
const SECTOR: u64 = 512;

/// One reading of a device's counters (Documentation/block/stat.rst: the first eleven fields).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlockCounters {
    pub read_requests: u64,
    pub read_merges: u64,
    pub read_sectors: u64,
    pub write_requests: u64,
    pub write_merges: u64,
    pub write_sectors: u64,
    /// Milliseconds with at least one request in flight.
    pub io_ms: u64,
    /// Milliseconds of requests in flight, summed over the requests (the queue's area).
    pub queue_ms: u64,
}

impl BlockCounters {
    /// The counters of device `major:minor` (as [`crate::TierInfo::device_id`] names it), or `None`
    /// where it has none (not a block device, or no sysfs).
    pub fn read(device_id: &str) -> Option<Self> {
        let text = std::fs::read_to_string(format!("/sys/dev/block/{device_id}/stat")).ok()?;
        Self::parse(&text)
    }

    fn parse(text: &str) -> Option<Self> {
        let f: Vec<u64> = text
            .split_whitespace()
            .map(str::parse)
            .collect::<std::result::Result<_, _>>()
            .ok()?;
        (f.len() >= 11).then(|| BlockCounters {
            read_requests: f[0],
            read_merges: f[1],
            read_sectors: f[2],
            write_requests: f[4],
            write_merges: f[5],
            write_sectors: f[6],
            io_ms: f[9],
            queue_ms: f[10],
        })
    }
}

/// What reached a device between two readings of its counters `secs` apart.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct BlockActivity {
    pub secs: f64,
    pub read_bytes: u64,
    pub write_bytes: u64,
    pub read_requests: u64,
    pub write_requests: u64,
    /// Mean size of a completed request, per direction (0 without requests).
    pub read_request_bytes: f64,
    pub write_request_bytes: f64,
    /// The share of requests the block layer merged into others, per direction.
    pub read_merged: f64,
    pub write_merged: f64,
    /// Mean requests in flight at the device (the queue's area over the time).
    pub queue_depth: f64,
    /// The share of the time with at least one request in flight.
    pub busy: f64,
}

impl BlockActivity {
    pub fn between(before: &BlockCounters, after: &BlockCounters, secs: f64) -> Self {
        let d = |a: u64, b: u64| a.saturating_sub(b);
        let (reads, writes) = (
            d(after.read_requests, before.read_requests),
            d(after.write_requests, before.write_requests),
        );
        let (read_merges, write_merges) = (
            d(after.read_merges, before.read_merges),
            d(after.write_merges, before.write_merges),
        );
        let (read_bytes, write_bytes) = (
            d(after.read_sectors, before.read_sectors) * SECTOR,
            d(after.write_sectors, before.write_sectors) * SECTOR,
        );
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        let ms = secs * 1e3;
        BlockActivity {
            secs,
            read_bytes,
            write_bytes,
            read_requests: reads,
            write_requests: writes,
            read_request_bytes: ratio(read_bytes as f64, reads as f64),
            write_request_bytes: ratio(write_bytes as f64, writes as f64),
            read_merged: ratio(read_merges as f64, (reads + read_merges) as f64),
            write_merged: ratio(write_merges as f64, (writes + write_merges) as f64),
            queue_depth: ratio(d(after.queue_ms, before.queue_ms) as f64, ms),
            busy: ratio(d(after.io_ms, before.io_ms) as f64, ms).min(1.0),
        }
    }
}

/// Measures what reaches device `device_id` while `f` runs: `f`'s result and the device's activity
/// (`None` for a device without counters).
pub fn observe<T>(device_id: &str, f: impl FnOnce() -> T) -> (T, Option<BlockActivity>) {
    let before = BlockCounters::read(device_id);
    let start = std::time::Instant::now();
    let out = f();
    let secs = start.elapsed().as_secs_f64();
    let activity = before
        .zip(BlockCounters::read(device_id))
        .map(|(b, a)| BlockActivity::between(&b, &a, secs));
    (out, activity)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activity_is_the_difference_of_two_readings() {
        let before = BlockCounters::parse(
            "   100    50   8000    10   200   100  16000   20    0   500  1000    0 0 0 0",
        )
        .unwrap();
        let after = BlockCounters::parse(
            "   110    80   8000    10   220   100  24192   20    3  1500  9000    0 0 0 0",
        )
        .unwrap();
        let a = BlockActivity::between(&before, &after, 2.0);
        assert_eq!((a.read_requests, a.write_requests), (10, 20));
        assert_eq!((a.read_bytes, a.write_bytes), (0, 8192 * 512));
        assert_eq!(a.write_request_bytes, 8192.0 * 512.0 / 20.0);
        // 30 merged into 10 requests: 30 of 40 asked for.
        assert_eq!(a.read_merged, 0.75);
        assert_eq!(a.write_merged, 0.0);
        // 8000 ms of requests in 2000 ms: 4 at once on average; busy half the time.
        assert_eq!(a.queue_depth, 4.0);
        assert_eq!(a.busy, 0.5);
        assert_eq!(a.read_request_bytes, 0.0);
    }

    #[test]
    fn unreadable_counters_are_none() {
        // name, text
        let cases = [
            ("too few fields", "1 2 3"),
            ("not numbers", "a b c d e f g h i j k"),
            ("empty", ""),
        ];
        for (name, text) in cases {
            assert_eq!(BlockCounters::parse(text), None, "{name}");
        }
        assert_eq!(BlockCounters::read("0:0"), None);
    }

    #[test]
    fn the_work_disk_has_counters_that_move() {
        let dir = tempfile::tempdir().unwrap();
        let tier = crate::probe_dir(dir.path()).unwrap();
        if BlockCounters::read(&tier.device_id).is_none() {
            return; // tmpfs or overlay here: nothing to observe
        }
        let (_, activity) = observe(&tier.device_id, || {
            std::fs::write(dir.path().join("f"), vec![7u8; 1 << 20]).unwrap();
            let f = std::fs::File::open(dir.path().join("f")).unwrap();
            f.sync_all().unwrap();
        });
        let activity = activity.unwrap();
        assert!(activity.write_bytes >= 1 << 20, "{activity:?}");
    }
}
