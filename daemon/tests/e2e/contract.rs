//! The contract as callers in other languages see it: generation options as an `a{sv}`
//! dictionary read by name, sentence marks, and the shipped introspection XML, which must be
//! exactly what the daemon serves.

use std::collections::HashMap;

use leanstream::contract::{
    BUS_NAME, GenerateParams, MANAGER_INTERFACE, MANAGER_PATH, SESSION_INTERFACE,
};
use leanstream_e2e::*;
use zbus::zvariant::{OwnedFd, Value};

/// The shipped XML, installed under `/usr/share/dbus-1/interfaces/`.
const XML: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../systemd/io.github.leanstream.LeanStream1.xml"
);

/// `Generate` with options built by hand, as a Python or C caller sends them.
async fn generate_raw(
    session: &leanstream::contract::SessionProxy<'_>,
    options: HashMap<&str, Value<'_>>,
) -> Result<OwnedFd, zbus::Error> {
    let reply = (session.inner())
        .call_method("Generate", &(STORY_PROMPT, options))
        .await?;
    reply.body().deserialize()
}

#[test]
fn options_are_read_by_name_whatever_the_integer_type() -> anyhow::Result<()> {
    runtime().block_on(async {
        let bus = Bus::start()?;
        let _daemon = crate::start_daemon(&bus, &DaemonConfig::default()).await?;
        let c = Client::new(&bus).await?;
        let s = c.open(256).await?;
        let typed = read_stream(s.generate(STORY_PROMPT, &greedy(5)).await?).await?;
        // A signed max_tokens and an integer temperature, as a dynamic language sends them.
        let options = HashMap::from([("max_tokens", Value::I32(5)), ("temperature", Value::U8(0))]);
        let raw = read_stream(generate_raw(&s, options).await?).await?;
        assert_eq!(raw.ids, typed.ids);
        assert_eq!(raw.ids.len(), 5);
        for (options, names) in [
            (
                HashMap::from([("max_token", Value::U32(5))]),
                "\"max_token\"",
            ),
            (
                HashMap::from([("max_tokens", Value::from("5"))]),
                "max_tokens",
            ),
            (
                HashMap::from([("max_tokens", Value::I32(-5))]),
                "max_tokens",
            ),
            (HashMap::from([("regex", Value::from("[0-9]"))]), ""),
        ] {
            match generate_raw(&s, options.clone())
                .await
                .map_err(leanstream::contract::LeanStreamError::from)
            {
                Err(leanstream::contract::LeanStreamError::InvalidArgument(m))
                    if !names.is_empty() =>
                {
                    assert!(m.contains(names), "{m}");
                }
                Ok(fd) if names.is_empty() => {
                    let out = read_stream(fd).await?;
                    assert!(
                        out.text.chars().all(|c| c.is_ascii_digit()),
                        "{:?}",
                        out.text
                    );
                }
                other => anyhow::bail!("{options:?}: {other:?}"),
            }
        }
        s.close().await?;
        Ok(())
    })
}

#[test]
fn sentence_marks_cut_the_text_into_pieces_that_end_at_marks() -> anyhow::Result<()> {
    runtime().block_on(async {
        let bus = Bus::start()?;
        let _daemon = crate::start_daemon(&bus, &DaemonConfig::default()).await?;
        let c = Client::new(&bus).await?;
        let s = c.open(256).await?;
        let params = GenerateParams {
            sentences: true,
            ..greedy(64)
        };
        let marked = read_stream(s.generate(STORY_PROMPT, &params).await?).await?;
        let plain = read_stream(s.generate(STORY_PROMPT, &greedy(64)).await?).await?;
        assert_eq!(marked.ids, plain.ids, "marks change nothing else");
        assert!(marked.sentences.len() >= 2, "{:?}", marked.sentences);
        assert!(plain.sentences.is_empty());
        // The pieces hold the text, whitespace aside, in order.
        let squeeze = |t: &str| t.split_whitespace().collect::<Vec<_>>().join(" ");
        assert_eq!(squeeze(&marked.sentences.join(" ")), squeeze(&marked.text));
        let (last, pieces) = marked
            .sentences
            .split_last()
            .unwrap_or_else(|| unreachable!());
        for piece in pieces {
            let end = piece.trim_end_matches(['"', '\'', ')', ']']);
            let marked_end = end.ends_with(['.', '!', '?', ';', ':']);
            assert!(
                marked_end || marked.text.contains(&format!("{piece}\n")),
                "{piece:?}"
            );
        }
        assert!(!last.is_empty());
        s.close().await?;
        Ok(())
    })
}

#[test]
fn tokenize_counts_what_generate_runs_and_apply_template_shows_the_chat_prompt()
-> anyhow::Result<()> {
    runtime().block_on(async {
        let bus = Bus::start()?;
        let _daemon = crate::start_daemon(&bus, &DaemonConfig::default()).await?;
        let c = Client::new(&bus).await?;
        let s = c.open(256).await?;
        let ids = s.tokenize(STORY_PROMPT).await?;
        let out = read_stream(s.generate(STORY_PROMPT, &greedy(1)).await?).await?;
        let Some(leanstream::contract::StreamEvent::Done { stats, .. }) = out.end else {
            anyhow::bail!("{:?}", out.end);
        };
        assert_eq!(ids.len(), stats.prompt_tokens);
        let turn = leanstream::contract::ChatTurn {
            role: "user".into(),
            content: "Where is the red cup?".into(),
        };
        let prompt = s.apply_template(&[turn]).await?;
        assert!(prompt.contains("Where is the red cup?"), "{prompt:?}");
        assert!(
            prompt.len() > "Where is the red cup?".len(),
            "the template added its markup"
        );
        let bad = leanstream::contract::ChatTurn {
            role: "robot".into(),
            content: "hi".into(),
        };
        assert_eq!(
            error_name(s.apply_template(&[bad]).await),
            "InvalidArgument"
        );
        s.close().await?;
        Ok(())
    })
}

/// The `<interface>` element named `name` in an introspection document, indented by two.
fn interface(xml: &str, name: &str) -> anyhow::Result<String> {
    let open = format!("<interface name=\"{name}\">");
    let start = (xml.find(&open)).ok_or_else(|| anyhow::anyhow!("no interface {name} in {xml}"))?;
    let line_start = xml[..start].rfind('\n').map_or(0, |i| i + 1);
    let indent = start - line_start;
    let len = xml[start..].find("</interface>").unwrap_or(0) + "</interface>".len();
    let lines: Vec<String> = (xml[line_start..start + len].lines())
        .map(|l| {
            let spaces = l.len() - l.trim_start().len();
            format!(
                "  {}{}",
                " ".repeat(spaces.saturating_sub(indent)),
                l.trim_start()
            )
        })
        .collect();
    Ok(lines.join("\n"))
}

#[test]
fn the_shipped_interface_xml_is_what_the_daemon_serves() -> anyhow::Result<()> {
    runtime().block_on(async {
        let bus = Bus::start()?;
        let _daemon = crate::start_daemon(&bus, &DaemonConfig::default()).await?;
        let c = Client::new(&bus).await?;
        let s = c.open(64).await?;
        let introspect = |path: String| {
            let conn = c.conn.clone();
            async move {
                let proxy = zbus::fdo::IntrospectableProxy::builder(&conn)
                    .destination(BUS_NAME)?
                    .path(path)?
                    .build()
                    .await?;
                anyhow::Ok(proxy.introspect().await?)
            }
        };
        let manager = interface(&introspect(MANAGER_PATH.into()).await?, MANAGER_INTERFACE)?;
        let session = interface(
            &introspect(s.inner().path().to_string()).await?,
            SESSION_INTERFACE,
        )?;
        let served = format!(
            "<!DOCTYPE node PUBLIC \"-//freedesktop//DTD D-BUS Object Introspection 1.0//EN\"\n \
             \"http://www.freedesktop.org/standards/dbus/1.0/introspect.dtd\">\n\
             <!-- The interfaces of leanstreamd (docs/clients.md). The end-to-end test\n     \
             contract::the_shipped_interface_xml_is_what_the_daemon_serves checks this file\n     \
             against the running daemon; LEANSTREAM_BLESS=1 rewrites it. -->\n\
             <node>\n{manager}\n{session}\n</node>\n"
        );
        if std::env::var_os("LEANSTREAM_BLESS").is_some() {
            std::fs::write(XML, &served)?;
        }
        let shipped = std::fs::read_to_string(XML)?;
        assert!(
            shipped == served,
            "{XML} differs from what the daemon serves; if the contract changed on purpose, \
             rerun with LEANSTREAM_BLESS=1. Served:\n{served}"
        );
        s.close().await?;
        Ok(())
    })
}
