//! What a scenario reports: latency percentiles, ratios, and the JSON every figure goes to.

use hdrhistogram::Histogram;
use serde::Serialize;
use serde_json::Value;

/// A latency distribution, in microseconds.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Latency {
    pub count: u64,
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
}

impl Latency {
    /// From a histogram of nanoseconds.
    pub fn from_nanos(h: &Histogram<u64>) -> Self {
        let us = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
        Self {
            count: h.len(),
            p50_us: us(0.50),
            p99_us: us(0.99),
            p999_us: us(0.999),
            max_us: h.max() as f64 / 1000.0,
        }
    }
}

/// A histogram of nanoseconds from 1 ns to 100 s, three significant digits.
pub fn nanos_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 100_000_000_000, 3).expect("valid histogram bounds")
}

/// `a / b`, rounded to three decimals; `b` of zero gives infinity (which the check refuses).
pub fn ratio(a: f64, b: f64) -> f64 {
    if b == 0.0 {
        return f64::INFINITY;
    }
    (a / b * 1000.0).round() / 1000.0
}

/// Every place in a report where a figure is missing: a scenario without `baseline` or `ratio`,
/// a null, or a number that is not finite (serde_json writes those as null).
pub fn missing(report: &Value, scenarios: &[&str]) -> Vec<String> {
    let mut gaps = Vec::new();
    for name in scenarios {
        match report.get(*name) {
            None => gaps.push(format!("{name}: absent")),
            Some(section) => {
                for key in ["baseline", "ratio"] {
                    if section.get(key).is_none() {
                        gaps.push(format!("{name}.{key}: absent"));
                    }
                }
                walk(section, name.to_string(), &mut gaps);
            }
        }
    }
    gaps
}

fn walk(v: &Value, path: String, gaps: &mut Vec<String>) {
    match v {
        Value::Null => gaps.push(format!("{path}: null")),
        Value::Number(n) if n.as_f64().is_none_or(|f| !f.is_finite()) => {
            gaps.push(format!("{path}: not a finite number"))
        }
        Value::Object(m) => {
            for (k, v) in m {
                walk(v, format!("{path}.{k}"), gaps);
            }
        }
        Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                walk(v, format!("{path}[{i}]"), gaps);
            }
        }
        _ => {}
    }
}

/// A scenario's figures as a table: one `path  value` row per leaf.
pub fn table(name: &str, section: &Value) -> String {
    let mut rows = Vec::new();
    flatten(section, String::new(), &mut rows);
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    let mut out = format!("── {name} ──\n");
    for (k, v) in rows {
        out.push_str(&format!("  {k:<width$}  {v}\n"));
    }
    out
}

fn flatten(v: &Value, path: String, rows: &mut Vec<(String, String)>) {
    let join = |k: &str| {
        if path.is_empty() {
            k.to_string()
        } else {
            format!("{path}.{k}")
        }
    };
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                flatten(v, join(k), rows);
            }
        }
        Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                flatten(v, format!("{path}[{i}]"), rows);
            }
        }
        Value::Number(n) => rows.push((path, format_number(n))),
        other => rows.push((path, other.to_string())),
    }
}

fn format_number(n: &serde_json::Number) -> String {
    match (n.as_u64(), n.as_f64()) {
        (Some(u), _) => u.to_string(),
        (None, Some(f)) if f.abs() >= 100.0 => format!("{f:.0}"),
        (None, Some(f)) => format!("{f:.3}"),
        _ => n.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_report_without_a_baseline_a_ratio_or_a_figure_is_incomplete() {
        let complete = json!({"hop": {"baseline": {"p99_us": 10.0}, "ratio": 1.5, "p99_us": 15.0}});
        assert!(missing(&complete, &["hop"]).is_empty());

        let gaps = missing(&json!({"hop": {"ratio": 1.0, "x": null}}), &["hop", "edge"]);
        assert_eq!(
            gaps,
            vec!["hop.baseline: absent", "hop.x: null", "edge: absent"]
        );
    }

    #[test]
    fn latency_percentiles_come_out_in_microseconds() {
        let mut h = nanos_histogram();
        for us in 1..=1000u64 {
            h.record(us * 1000).unwrap();
        }
        let l = Latency::from_nanos(&h);
        assert_eq!(l.count, 1000);
        assert!((l.p50_us - 500.0).abs() < 1.0, "{l:?}");
        assert!((l.p99_us - 990.0).abs() < 1.0, "{l:?}");
        assert_eq!(ratio(3.0, 2.0), 1.5);
        assert!(ratio(1.0, 0.0).is_infinite());
    }
}
