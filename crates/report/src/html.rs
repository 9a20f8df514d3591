//! Owns the self-contained HTML page: the charts as inline SVG and the figures as tables.
//! Keeps: no script and no external file; the page opens offline.
use crate::series::Summary;
use crate::sweep::Sweep;

pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            _ => out.push(c),
        }
    }
    out
}

const STYLE: &str = "body{font-family:'DejaVu Sans',Verdana,sans-serif;margin:24px;color:#282828}\
h1{font-size:22px;font-weight:normal}table{border-collapse:collapse;margin:12px 0 20px}\
th,td{padding:4px 12px;border-bottom:1px solid #ddd;text-align:left;font-size:14px}\
th{border-bottom:2px solid #999}td.n{text-align:right;font-variant-numeric:tabular-nums}\
tr.best{background:#fff3bf}.bad{color:#c81e1e}.swatch{display:inline-block;width:12px;height:12px;margin-right:8px;vertical-align:-1px}\
ul.warn{color:#8a5a00}svg{max-width:100%;height:auto}";

fn page(title: &str, body: &str, warnings: &[String]) -> String {
    let mut w = String::new();
    if !warnings.is_empty() {
        w.push_str("<ul class=\"warn\">");
        for x in warnings {
            w += &format!("<li>warning: {}</li>", escape(x));
        }
        w.push_str("</ul>");
    }
    format!(
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{t}</title><style>{STYLE}</style></head>\n<body><h1>{t}</h1>{w}\n\
            {body}\n</body></html>\n",
        t = escape(title)
    )
}

pub fn run(title: &str, summary: &Summary, svg: &str, warnings: &[String]) -> String {
    let mut body = String::from("<table>");
    for (k, v) in summary.rows() {
        body += &format!("<tr><th>{}</th><td class=\"n\">{}</td></tr>", escape(k), escape(&v));
    }
    body += "</table>\n";
    body += svg;
    page(title, &body, warnings)
}

pub fn sweep(title: &str, s: &Sweep, svg: &str, warnings: &[String]) -> String {
    let (header, rows) = s.table();
    let mut body = format!("<p>{}</p>\n", escape(&s.counts()));
    body += svg;
    body += "\n<table><tr>";
    for h in &header {
        body += &format!("<th>{}</th>", escape(h));
    }
    body += "</tr>\n";
    let numeric = |c: usize| (3..=7).contains(&c);
    for (i, row) in &rows {
        let (i, t) = (*i, &s.trials[*i]);
        body += if s.best == Some(i) {
            "<tr class=\"best\">"
        } else {
            "<tr>"
        };
        for (c, cell) in row.iter().enumerate() {
            let class = match c {
                2 if !t.is_ok() => " class=\"bad\"",
                c if numeric(c) => " class=\"n\"",
                _ => "",
            };
            let swatch = if c == 1 && !t.eval_loss.is_empty() {
                let c = crate::sweep_chart::colour(i);
                format!(
                    "<span class=\"swatch\" style=\"background:rgb({},{},{})\"></span>",
                    c.0, c.1, c.2
                )
            } else {
                String::new()
            };
            let title = match (&t.record.message, c) {
                (Some(m), 2) => format!(" title=\"{}\"", escape(m)),
                _ => String::new(),
            };
            body += &format!("<td{class}{title}>{swatch}{}</td>", escape(cell));
        }
        body += "</tr>\n";
    }
    body += "</table>";
    page(title, &body, warnings)
}

#[cfg(test)]
mod tests {
    #[test]
    fn markup_in_names_is_escaped() {
        assert_eq!(super::escape("<a href=\"x\">&"), "&lt;a href=&quot;x&quot;&gt;&amp;");
    }
}
