//! The latency histograms every request records into (request, upstream try, store
//! call): fixed buckets from 0.5 ms to 10 s, an observation a bucket's atomic count and
//! the sum's, without a lock. `prometheus_client`'s `Histogram` takes a mutex per
//! observation, which worker threads recording the same route contend for.
//!
//! A scrape reads the buckets one by one while requests go on: its count is the sum of
//! the buckets it read, so the buckets and the count always agree; the sum may include
//! an observation or two more or fewer than the count, as between any two scrapes.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::{MetricType, TypedMetric};

/// The buckets' upper bounds, in seconds (an implicit `+Inf` bucket follows).
const BOUNDS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// The same bounds in nanoseconds, which an observation is compared with.
const BOUNDS_NANOS: [u64; BOUNDS.len()] = {
    let mut nanos = [0; BOUNDS.len()];
    let mut i = 0;
    while i < BOUNDS.len() {
        nanos[i] = (BOUNDS[i] * 1e9) as u64;
        i += 1;
    }
    nanos
};

/// A duration histogram; clones record into the same counts.
#[derive(Debug, Clone, Default)]
pub(crate) struct DurationHistogram(Arc<Counts>);

#[derive(Debug, Default)]
struct Counts {
    /// Observations per bucket (not cumulative), the last one `+Inf`'s.
    buckets: [AtomicU64; BOUNDS.len() + 1],
    /// The sum of the observations in seconds, as `f64` bits.
    sum: AtomicU64,
}

impl DurationHistogram {
    pub(crate) fn observe(&self, duration: Duration) {
        let nanos = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
        let bucket = BOUNDS_NANOS
            .iter()
            .position(|&bound| nanos <= bound)
            .unwrap_or(BOUNDS.len());
        self.0.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        let seconds = duration.as_secs_f64();
        // Uncontended, one compare-and-swap.
        let _ = self
            .0
            .sum
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |sum| {
                Some((f64::from_bits(sum) + seconds).to_bits())
            });
    }

    /// The sum, the count, and each bucket's upper bound and own count.
    fn snapshot(&self) -> (f64, u64, [(f64, u64); BOUNDS.len() + 1]) {
        let mut buckets = [(f64::INFINITY, 0); BOUNDS.len() + 1];
        for (i, (bound, count)) in buckets.iter_mut().enumerate() {
            if let Some(&finite) = BOUNDS.get(i) {
                *bound = finite;
            }
            *count = self.0.buckets[i].load(Ordering::Relaxed);
        }
        let count = buckets.iter().map(|(_, count)| count).sum();
        (f64::from_bits(self.0.sum.load(Ordering::Relaxed)), count, buckets)
    }
}

impl TypedMetric for DurationHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for DurationHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let (sum, count, buckets) = self.snapshot();
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

#[cfg(test)]
mod tests {
    use prometheus_client::encoding::text::encode;
    use prometheus_client::metrics::histogram::Histogram;
    use prometheus_client::registry::Registry;

    use super::*;

    fn text(metric: impl prometheus_client::registry::Metric) -> String {
        let mut registry = Registry::default();
        registry.register("latency_seconds", "Latency", metric);
        let mut out = String::new();
        encode(&mut out, &registry).unwrap();
        out
    }

    #[test]
    fn it_reads_as_prometheus_clients_own_histogram_of_the_same_observations() {
        let ours = DurationHistogram::default();
        let theirs = Histogram::new(BOUNDS);
        // On, below and above bounds, the smallest and beyond the largest.
        let observations = [
            0,
            1,
            499_999,
            500_000,
            500_001,
            1_000_000,
            7_000_000,
            2_500_000_000,
        ]
        .map(Duration::from_nanos)
        .into_iter()
        .chain([Duration::from_secs(10), Duration::from_secs(11), Duration::MAX]);
        for observation in observations {
            ours.observe(observation);
            theirs.observe(observation.as_secs_f64());
        }
        assert_eq!(text(ours), text(theirs));
    }

    #[test]
    fn bounds_in_nanoseconds_are_the_bounds_in_seconds() {
        for (seconds, nanos) in BOUNDS.iter().zip(BOUNDS_NANOS) {
            assert_eq!(Duration::from_secs_f64(*seconds), Duration::from_nanos(nanos));
        }
    }
}
