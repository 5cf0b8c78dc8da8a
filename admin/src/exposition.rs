//! The two text formats `/metrics` speaks: OpenMetrics 1.0, which the registry encodes, and the
//! classic Prometheus text format 0.0.4, which `promtool` and many scrapers read.
//!
//! `prometheus-client` encodes OpenMetrics only, so the classic page is the OpenMetrics page
//! rewritten ([`to_classic`]): `# EOF` and `# UNIT` lines dropped, a counter family's `HELP` and
//! `TYPE` put under its `_total` sample name (and its `_created` samples dropped), an info family
//! typed as a gauge under its `_info` sample name, `unknown` spelt `untyped`, exemplars removed,
//! timestamps turned from seconds into milliseconds, and `HELP` text re-escaped.

/// The content type of an OpenMetrics page.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The content type of a classic Prometheus text page.
pub const CLASSIC_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// A text format of the metrics page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0 (`application/openmetrics-text`).
    OpenMetrics,
    /// The Prometheus text format 0.0.4 (`text/plain`).
    Classic,
}

impl Format {
    /// The format a scraper's `Accept` header asks for: OpenMetrics when it accepts
    /// `application/openmetrics-text` at least as much as `text/plain`, the classic format
    /// otherwise (no header, `*/*`, `text/plain`, or only types neither format is).
    pub fn negotiate(accept: Option<&str>) -> Self {
        let Some(accept) = accept else {
            return Self::Classic;
        };
        // The weight of the most specific range matching each format: (specificity, q).
        let mut openmetrics: Option<(u8, f32)> = None;
        let mut text: Option<(u8, f32)> = None;
        let better = |slot: &mut Option<(u8, f32)>, specificity: u8, q: f32| match slot {
            Some((s, old)) if *s > specificity || (*s == specificity && *old >= q) => {}
            _ => *slot = Some((specificity, q)),
        };
        for range in accept.split(',') {
            let mut parts = range.split(';');
            let media = parts.next().unwrap_or("").trim().to_ascii_lowercase();
            let mut q = 1.0f32;
            for param in parts {
                if let Some((key, value)) = param.split_once('=') {
                    if key.trim().eq_ignore_ascii_case("q") {
                        q = value.trim().parse().unwrap_or(0.0);
                    }
                }
            }
            match media.as_str() {
                "application/openmetrics-text" => better(&mut openmetrics, 2, q),
                "application/*" => better(&mut openmetrics, 1, q),
                "text/plain" => better(&mut text, 2, q),
                "text/*" => better(&mut text, 1, q),
                "*/*" => better(&mut text, 0, q),
                _ => {}
            }
        }
        let openmetrics = openmetrics.map_or(0.0, |(_, q)| q);
        let text = text.map_or(0.0, |(_, q)| q);
        if openmetrics > 0.0 && openmetrics >= text {
            Self::OpenMetrics
        } else {
            Self::Classic
        }
    }

    /// The `Content-Type` of a page in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Self::OpenMetrics => OPENMETRICS_CONTENT_TYPE,
            Self::Classic => CLASSIC_CONTENT_TYPE,
        }
    }
}

/// One metric family's metadata, written out before its first sample (or at its end, if it has
/// none).
#[derive(Default)]
struct Family {
    name: String,
    help: Option<String>,
    kind: Option<String>,
    written: bool,
}

impl Family {
    fn kind(&self) -> &str {
        self.kind.as_deref().unwrap_or("unknown")
    }

    /// The family's name in the classic format, where a family is named like its samples.
    fn classic_name(&self) -> String {
        match self.kind() {
            "counter" => format!("{}_total", self.name),
            "info" => format!("{}_info", self.name),
            _ => self.name.clone(),
        }
    }

    fn classic_kind(&self) -> &'static str {
        match self.kind() {
            "counter" => "counter",
            "gauge" | "info" | "stateset" => "gauge",
            "histogram" => "histogram",
            "summary" => "summary",
            _ => "untyped",
        }
    }

    /// Writes the family's `HELP` and `TYPE` lines, once.
    fn write_header(&mut self, out: &mut String) {
        if self.written || self.name.is_empty() {
            return;
        }
        self.written = true;
        let name = self.classic_name();
        if let Some(help) = &self.help {
            out.push_str("# HELP ");
            out.push_str(&name);
            out.push(' ');
            out.push_str(&escape_help(help));
            out.push('\n');
        }
        out.push_str("# TYPE ");
        out.push_str(&name);
        out.push(' ');
        out.push_str(self.classic_kind());
        out.push('\n');
    }

    /// Whether the classic format has no place for `sample` (a sample name) of this family.
    fn drops(&self, sample: &str) -> bool {
        let Some(suffix) = sample.strip_prefix(self.name.as_str()) else {
            return false;
        };
        match self.kind() {
            "counter" | "histogram" | "summary" => suffix == "_created",
            _ => false,
        }
    }
}

/// The OpenMetrics page `openmetrics` in the classic Prometheus text format 0.0.4.
pub fn to_classic(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len());
    let mut family = Family::default();
    for line in openmetrics.lines() {
        if line.trim().is_empty() {
            continue;
        }
        if let Some(comment) = line.strip_prefix('#') {
            let comment = comment.trim_start();
            if comment == "EOF" {
                break;
            }
            let (keyword, rest) = comment.split_once(' ').unwrap_or((comment, ""));
            if !matches!(keyword, "HELP" | "TYPE" | "UNIT") {
                continue;
            }
            let (name, value) = rest.split_once(' ').unwrap_or((rest, ""));
            if name != family.name {
                family.write_header(&mut out);
                family = Family {
                    name: name.to_string(),
                    ..Family::default()
                };
            }
            match keyword {
                "HELP" => family.help = Some(unescape_help(value)),
                "TYPE" => family.kind = Some(value.trim().to_string()),
                _ => {}
            }
            continue;
        }
        let Some(sample) = Sample::parse(line) else {
            continue;
        };
        if family.drops(sample.name) {
            continue;
        }
        family.write_header(&mut out);
        sample.write_classic(&mut out);
    }
    family.write_header(&mut out);
    out
}

/// One sample line of an OpenMetrics page.
struct Sample<'a> {
    name: &'a str,
    /// `{…}` with its braces, or empty.
    labels: &'a str,
    value: &'a str,
    /// In seconds, as OpenMetrics writes it.
    timestamp: Option<&'a str>,
}

impl<'a> Sample<'a> {
    /// `name{labels} value [timestamp] [# exemplar]`; `None` for a line that is not one.
    fn parse(line: &'a str) -> Option<Self> {
        let line = line.trim_start();
        let name_end = line
            .find(|c: char| c == '{' || c.is_whitespace())
            .unwrap_or(line.len());
        let name = &line[..name_end];
        let mut rest = &line[name_end..];
        let mut labels = "";
        if rest.starts_with('{') {
            let end = labels_end(rest)?;
            labels = &rest[..end];
            rest = &rest[end..];
        }
        let mut fields = rest.split_whitespace();
        let value = fields.next()?;
        let timestamp = fields.next().filter(|t| *t != "#");
        (!name.is_empty()).then_some(Self {
            name,
            labels,
            value,
            timestamp,
        })
    }

    fn write_classic(&self, out: &mut String) {
        out.push_str(self.name);
        out.push_str(self.labels);
        out.push(' ');
        out.push_str(self.value);
        if let Some(ms) = self.timestamp.and_then(seconds_to_ms) {
            out.push(' ');
            out.push_str(&ms.to_string());
        }
        out.push('\n');
    }
}

/// The length of the label set `{…}` that `text` starts with, braces included, skipping what is
/// quoted (a label value may hold `}`, `#` and escaped quotes).
fn labels_end(text: &str) -> Option<usize> {
    let mut quoted = false;
    let mut escaped = false;
    for (i, c) in text.char_indices() {
        if quoted {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => quoted = false,
                _ => {}
            }
        } else if c == '"' {
            quoted = true;
        } else if c == '}' {
            return Some(i + 1);
        }
    }
    None
}

/// An OpenMetrics timestamp (seconds, maybe fractional) in whole milliseconds.
fn seconds_to_ms(seconds: &str) -> Option<i64> {
    let s: f64 = seconds.parse().ok()?;
    s.is_finite().then(|| (s * 1000.0).round() as i64)
}

/// `HELP` text as OpenMetrics escapes it (`\\`, `\n`, `\"`), read back; any other backslash
/// stands for itself.
fn unescape_help(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.peek() {
            Some('\\') => out.push('\\'),
            Some('n') => out.push('\n'),
            Some('"') => out.push('"'),
            _ => {
                out.push('\\');
                continue;
            }
        }
        chars.next();
    }
    out
}

/// `HELP` text as the classic format escapes it: only `\\` and `\n`.
fn escape_help(text: &str) -> String {
    text.replace('\\', "\\\\").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::EncodeLabelSet;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family as Labelled;
    use prometheus_client::metrics::gauge::Gauge;
    use prometheus_client::metrics::histogram::Histogram;
    use prometheus_client::metrics::info::Info;
    use prometheus_client::registry::{Registry, Unit};

    #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
    struct Labels {
        kind: String,
    }

    fn encode(reg: &Registry) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, reg).unwrap();
        text
    }

    #[test]
    fn a_registry_of_every_kind_reads_as_the_classic_format() {
        let mut reg = Registry::with_prefix("app");
        let frames: Counter = Counter::default();
        frames.inc_by(3);
        reg.register("frames", "Frames read", frames);
        let open: Gauge = Gauge::default();
        open.set(-2);
        reg.register("open", "Connections open", open);
        let load = Gauge::<f64, std::sync::atomic::AtomicU64>::default();
        load.set(0.25);
        reg.register("load", "Share of the budget", load);
        let errors = Labelled::<Labels, Counter>::default();
        errors
            .get_or_create(&Labels {
                kind: "a } # kind".into(),
            })
            .inc();
        reg.register("errors", "Errors by kind", errors);
        let rtt = Histogram::new([0.01, 0.1]);
        rtt.observe(0.05);
        reg.register_with_unit("rtt", "Round trips", Unit::Seconds, rtt);
        // A family with no sample yet is left out of both pages.
        let empty = Labelled::<Labels, Counter>::default();
        reg.register("refused", "Refusals, by kind", empty);
        reg.register(
            "build",
            "What runs",
            Info::new(vec![("version".to_string(), "1.2".to_string())]),
        );

        let openmetrics = encode(&reg);
        assert!(openmetrics.ends_with("# EOF\n"), "{openmetrics}");
        let classic = to_classic(&openmetrics);
        let expected = "\
# HELP app_frames_total Frames read.
# TYPE app_frames_total counter
app_frames_total 3
# HELP app_open Connections open.
# TYPE app_open gauge
app_open -2
# HELP app_load Share of the budget.
# TYPE app_load gauge
app_load 0.25
# HELP app_errors_total Errors by kind.
# TYPE app_errors_total counter
app_errors_total{kind=\"a } # kind\"} 1
# HELP app_rtt_seconds Round trips.
# TYPE app_rtt_seconds histogram
app_rtt_seconds_sum 0.05
app_rtt_seconds_count 1
app_rtt_seconds_bucket{le=\"0.01\"} 0
app_rtt_seconds_bucket{le=\"0.1\"} 1
app_rtt_seconds_bucket{le=\"+Inf\"} 1
# HELP app_build_info What runs.
# TYPE app_build_info gauge
app_build_info{version=\"1.2\"} 1
";
        assert_eq!(classic, expected, "from\n{openmetrics}");
    }

    #[test]
    fn exemplars_created_samples_and_timestamps_are_rewritten() {
        let openmetrics = "\
# TYPE req counter
# UNIT req requests
# HELP req Requests: \\\"a\\\" \\\\ and\\nmore
req_total{code=\"200\",path=\"/a \\\"b\\\" } #\"} 7 1700000000.5 # {trace_id=\"x\"} 1.0
req_created{code=\"200\"} 1600000000
# TYPE lat histogram
lat_bucket{le=\"+Inf\"} 2 # {trace_id=\"y\"} 0.3 1700000000
lat_count 2
lat_sum 0.5
lat_created 1600000000
# TYPE thing unknown
thing 1
# EOF
ignored 1
";
        let expected = "\
# HELP req_total Requests: \"a\" \\\\ and\\nmore
# TYPE req_total counter
req_total{code=\"200\",path=\"/a \\\"b\\\" } #\"} 7 1700000000500
# TYPE lat histogram
lat_bucket{le=\"+Inf\"} 2
lat_count 2
lat_sum 0.5
# TYPE thing untyped
thing 1
";
        assert_eq!(to_classic(openmetrics), expected);
    }

    #[test]
    fn help_escapes_round_trip() {
        for text in ["plain", "a \\ b", "two\nlines", "say \"hi\"", "end \\"] {
            let openmetrics = text
                .replace('\\', "\\\\")
                .replace('\n', "\\n")
                .replace('"', "\\\"");
            assert_eq!(unescape_help(&openmetrics), text);
        }
        assert_eq!(escape_help("a \\ b\nc \""), "a \\\\ b\\nc \"");
        // A lone backslash, as an encoder that does not escape writes it, stands for itself.
        assert_eq!(unescape_help("C:\\dir"), "C:\\dir");
    }

    #[test]
    fn the_accept_header_picks_the_format() {
        use Format::*;
        let cases = [
            (None, Classic),
            (Some(""), Classic),
            (Some("*/*"), Classic),
            (Some("text/plain"), Classic),
            (Some("text/plain; version=0.0.4"), Classic),
            (Some("application/json"), Classic),
            (Some("application/openmetrics-text"), OpenMetrics),
            (
                Some("application/openmetrics-text; version=1.0.0"),
                OpenMetrics,
            ),
            (
                Some("Application/OpenMetrics-Text;Version=1.0.0"),
                OpenMetrics,
            ),
            // What Prometheus sends.
            (
                Some(
                    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
                     version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
                ),
                OpenMetrics,
            ),
            // What Prometheus sends with OpenMetrics scraping turned off.
            (Some("text/plain;version=0.0.4;q=1,*/*;q=0.1"), Classic),
            (
                Some("text/plain;q=0.9, application/openmetrics-text;q=0.5"),
                Classic,
            ),
            (
                Some("text/plain;q=0.5, application/openmetrics-text"),
                OpenMetrics,
            ),
            (Some("application/openmetrics-text;q=0"), Classic),
            (
                Some("application/openmetrics-text, text/plain"),
                OpenMetrics,
            ),
            // The specific range decides, not the wildcard.
            (
                Some("*/*;q=1, text/plain;q=0.1, application/openmetrics-text;q=0.5"),
                OpenMetrics,
            ),
            (Some("application/*"), OpenMetrics),
        ];
        for (accept, format) in cases {
            assert_eq!(Format::negotiate(accept), format, "{accept:?}");
        }
    }

    proptest::proptest! {
        #[test]
        fn any_text_converts_without_panicking(text in "(# ?(HELP|TYPE|UNIT|EOF) )?[a-z_{}=\"\\\\# .0-9\n]{0,80}") {
            let _ = to_classic(&text);
        }
    }

    #[test]
    fn an_empty_page_stays_empty() {
        assert_eq!(to_classic("# EOF\n"), "");
        assert_eq!(to_classic(""), "");
    }
}
