//! What each coding costs on a typical page, at the levels floodgate uses and beside
//! them: the figures behind the choice of brotli's quality (no more CPU than gzip's
//! default, docs/performance.md#compression).
//!
//! `cargo bench --bench compression`

use async_compression::Level;
use async_compression::tokio::bufread::{BrotliEncoder, GzipEncoder, ZstdEncoder};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use tokio::io::{AsyncRead, AsyncReadExt};

/// About 100 KB of HTML with the repetition real pages have.
fn page() -> Vec<u8> {
    (0..1500)
        .flat_map(|i| {
            format!(
                "<li class=\"item item-{}\"><a href=\"/products/{i}?ref=list\">Product {i}</a> <span>{}.99 EUR</span></li>\n",
                i % 7,
                i * 13 % 500
            )
            .into_bytes()
        })
        .collect()
}

async fn drain(mut encoder: impl AsyncRead + Unpin) -> usize {
    let mut out = Vec::new();
    encoder.read_to_end(&mut out).await.unwrap();
    out.len()
}

fn codings(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
    let page = page();
    let mut group = c.benchmark_group("compress_100k_html");
    group.throughput(Throughput::Bytes(page.len() as u64));
    group.bench_function("gzip_6", |b| {
        b.iter(|| runtime.block_on(drain(GzipEncoder::with_quality(&page[..], Level::Precise(6)))))
    });
    for quality in [3, 4, 5] {
        group.bench_function(format!("brotli_{quality}"), |b| {
            b.iter(|| {
                runtime.block_on(drain(BrotliEncoder::with_quality(
                    &page[..],
                    Level::Precise(quality),
                )))
            })
        });
    }
    group.bench_function("zstd_3", |b| {
        b.iter(|| runtime.block_on(drain(ZstdEncoder::with_quality(&page[..], Level::Precise(3)))))
    });
    group.finish();
    let size = |name: &str, bytes: usize| println!("{name}: {} -> {bytes} bytes", page.len());
    size(
        "gzip_6",
        runtime.block_on(drain(GzipEncoder::with_quality(&page[..], Level::Precise(6)))),
    );
    size(
        "zstd_3",
        runtime.block_on(drain(ZstdEncoder::with_quality(&page[..], Level::Precise(3)))),
    );
    for quality in [3, 4, 5] {
        let bytes = runtime.block_on(drain(BrotliEncoder::with_quality(
            &page[..],
            Level::Precise(quality),
        )));
        size(&format!("brotli_{quality}"), bytes);
    }
}

criterion_group!(benches, codings);
criterion_main!(benches);
