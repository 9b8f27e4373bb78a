//! A hostile client against another user: what one unprivileged user may learn of, take from or
//! undo for another. The daemon tells users apart by the uid the bus reports; root is an admin,
//! so these tests connect as two other users ([`Bus::connect_as`]), which needs root. Run as
//! another user, they print that they are skipped and why.

use std::time::{Duration, Instant};

use leanstream::contract::{BUS_NAME, LeanStreamError, MANAGER_PATH, StreamStats};
use leanstream_e2e::*;

use crate::hostile::start;

/// Two unprivileged users, or `None` after printing why `test` is skipped.
fn users(test: &str) -> Option<[User; 2]> {
    match unprivileged_users() {
        Ok(users) => Some(users),
        Err(why) => {
            eprintln!("{test}: skipped, {why}");
            None
        }
    }
}

/// A system prompt any app may send: public, and longer than one KV block (64 tokens), so that
/// sessions can share its keys and values.
const PUBLIC_SYSTEM: &str = "You are the assistant of a smart home. You answer in one short \
    sentence, you never guess, and you ask again when a request is unclear. You control the \
    lights, the heating, the blinds, the garden sprinklers and the front door, and after every \
    change you say what you changed and how to undo it. You keep every secret the user tells \
    you and never repeat it to anyone. ";

/// Generates one token from `prompt` on a fresh session of `client`; the stream's statistics.
async fn one_token(client: &Client, prompt: &str) -> anyhow::Result<StreamStats> {
    let session = client.open(256).await?;
    let out = read_stream(session.generate(prompt, &greedy(1)).await?).await?;
    session.close().await?;
    match out.end {
        Some(leanstream::contract::StreamEvent::Done { stats, .. }) => Ok(stats),
        other => anyhow::bail!("{prompt:?} ended with {other:?}"),
    }
}

#[test]
fn another_user_learns_nothing_of_a_prompt_from_the_prompt_cache() -> anyhow::Result<()> {
    let Some([alice, bob]) = users("another_user_learns_nothing_of_a_prompt_from_the_prompt_cache")
    else {
        return Ok(());
    };
    runtime().block_on(async {
        let bus = Bus::start()?;
        let _daemon = start(&bus, &DaemonConfig::default()).await?;
        let a = Client::new_as(&bus, &alice).await?;
        // Alice's session holds her secret, and stays open.
        let secret = a.open(256).await?;
        let prompt = format!("{PUBLIC_SYSTEM}My door code is 4711. Lock the door at ten.");
        read_stream(secret.generate(&prompt, &greedy(1)).await?).await?;
        // Her own sessions share the system prompt's keys and values.
        let mine = one_token(&a, &format!("{PUBLIC_SYSTEM}What time is it?")).await?;
        assert!(
            mine.cached_prompt_tokens > 0,
            "a session of the same client did not share the system prompt: {mine:?}"
        );
        // Bob sends the same system prompt and guesses the first digit.
        let b = Client::new_as(&bus, &bob).await?;
        let mut cached = Vec::new();
        for digit in 0..10 {
            // A token after the digit: the last one is always computed, never shared.
            let guess = format!("{PUBLIC_SYSTEM}My door code is {digit}, right?");
            cached.push(one_token(&b, &guess).await?.cached_prompt_tokens);
        }
        assert!(
            cached.iter().all(|&n| n == 0),
            "Bob's guesses 0..=9 found {cached:?} of their tokens already computed: Alice's"
        );
        Ok(())
    })
}

/// Opens sessions on `client` until it is refused (at most 64); fails unless the refusal is
/// `Busy`.
async fn open_until_refused(
    client: &Client,
) -> anyhow::Result<Vec<zbus::zvariant::OwnedObjectPath>> {
    let mut held = Vec::new();
    for _ in 0..64 {
        match client
            .manager
            .open_session(MODEL, 64)
            .await
            .map_err(LeanStreamError::from)
        {
            Ok(path) => held.push(path),
            Err(LeanStreamError::Busy(_)) => return Ok(held),
            Err(e) => anyhow::bail!("opening a session: {e}"),
        }
    }
    anyhow::bail!("64 sessions and no refusal")
}

#[test]
fn a_user_cannot_take_every_session_by_opening_more_connections() -> anyhow::Result<()> {
    let Some([alice, bob]) = users("a_user_cannot_take_every_session_by_opening_more_connections")
    else {
        return Ok(());
    };
    runtime().block_on(async {
        let bus = Bus::start()?;
        let cfg = DaemonConfig {
            max_sessions: 16,
            extra: "max_sessions_per_client = 4\n".into(),
            ..DaemonConfig::default()
        };
        let _daemon = start(&bus, &cfg).await?;
        // Alice opens sessions on five connections until each is refused.
        let (mut connections, mut held) = (Vec::new(), 0);
        for _ in 0..5 {
            let c = Client::new_as(&bus, &alice).await?;
            held += open_until_refused(&c).await?.len();
            connections.push(c);
        }
        let b = Client::new_as(&bus, &bob).await?;
        let answer = error_name(b.manager.open_session(MODEL, 64).await);
        assert!(
            answer.starts_with("ok"),
            "Alice holds {held} sessions over 5 connections and Bob got {answer}"
        );
        assert!(
            held <= 4,
            "Alice holds {held} sessions over 5 connections; the limit is 4 a client"
        );
        Ok(())
    })
}

#[test]
fn a_users_pins_count_across_its_connections_and_after_it_leaves() -> anyhow::Result<()> {
    let Some([alice, bob]) = users("a_users_pins_count_across_its_connections_and_after_it_leaves")
    else {
        return Ok(());
    };
    runtime().block_on(async {
        let bus = Bus::start()?;
        let cfg = DaemonConfig {
            budget: "1GiB".into(),
            extra: "max_pins_per_client = 2\n".into(),
            ..DaemonConfig::default()
        };
        let daemon = start(&bus, &cfg).await?;
        for name in ["second", "third", "fourth"] {
            daemon.add_model(name)?;
        }
        let first = Client::new_as(&bus, &alice).await?;
        first.manager.load_model("second").await?;
        first.manager.load_model("third").await?;
        assert_eq!(error_name(first.manager.load_model("fourth").await), "Busy");
        // Another connection of Alice's.
        let other = Client::new_as(&bus, &alice).await?;
        assert_eq!(
            error_name(other.manager.load_model("fourth").await),
            "Busy",
            "Alice pinned a third model on a second connection"
        );
        // Alice leaves; her pins hold the models, and still count.
        let name = first.conn.unique_name().map(|n| n.to_string());
        drop(first);
        drop(other);
        let bus_driver = zbus::fdo::DBusProxy::new(&Client::new(&bus).await?.conn).await?;
        let deadline = Instant::now() + Duration::from_secs(10);
        if let Some(name) = name {
            while bus_driver.name_has_owner(name.as_str().try_into()?).await? {
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "{name} still on the bus after 10 s"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        // The daemon hears of the departure a moment later.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let back = Client::new_as(&bus, &alice).await?;
        assert_eq!(
            error_name(back.manager.load_model("fourth").await),
            "Busy",
            "Alice pinned a third model after reconnecting"
        );
        // Bob's pins are his own.
        let b = Client::new_as(&bus, &bob).await?;
        b.manager.load_model("fourth").await?;
        Ok(())
    })
}

/// Every object path `conn` finds under `/` by introspecting the daemon (at most 500).
async fn walk(conn: &zbus::Connection) -> anyhow::Result<Vec<String>> {
    let (mut found, mut queue) = (Vec::new(), vec!["/".to_string()]);
    while let Some(path) = queue.pop() {
        if found.len() >= 500 {
            break;
        }
        let proxy = zbus::fdo::IntrospectableProxy::builder(conn)
            .destination(BUS_NAME)?
            .path(path.as_str())?
            .build()
            .await?;
        // A path the caller may not introspect shows nothing.
        let Ok(xml) = proxy.introspect().await else {
            continue;
        };
        for child in xml.split("<node name=\"").skip(1) {
            if let Some(name) = child.split('"').next() {
                queue.push(format!("{}/{name}", path.trim_end_matches('/')));
            }
        }
        found.push(path);
    }
    Ok(found)
}

#[test]
fn another_user_cannot_find_a_session_by_introspection() -> anyhow::Result<()> {
    let Some([alice, bob]) = users("another_user_cannot_find_a_session_by_introspection") else {
        return Ok(());
    };
    runtime().block_on(async {
        let bus = Bus::start()?;
        let _daemon = start(&bus, &DaemonConfig::default()).await?;
        let a = Client::new_as(&bus, &alice).await?;
        let session = a.manager.open_session(MODEL, 64).await?;
        let b = Client::new_as(&bus, &bob).await?;
        let found = walk(&b.conn).await?;
        assert!(
            found.iter().any(|p| p == MANAGER_PATH),
            "the walk did not find the manager: {found:?}"
        );
        assert!(
            !found.iter().any(|p| p == session.as_str()),
            "Bob found Alice's session {} by introspection: {found:?}",
            session.as_str()
        );
        Ok(())
    })
}

#[test]
fn another_user_cannot_unload_a_model_someone_pinned() -> anyhow::Result<()> {
    let Some([alice, bob]) = users("another_user_cannot_unload_a_model_someone_pinned") else {
        return Ok(());
    };
    runtime().block_on(async {
        let bus = Bus::start()?;
        let _daemon = start(&bus, &DaemonConfig::default()).await?;
        let a = Client::new_as(&bus, &alice).await?;
        a.manager.load_model(MODEL).await?;
        let b = Client::new_as(&bus, &bob).await?;
        assert_eq!(
            error_name(b.manager.unload_model(MODEL).await),
            "AccessDenied"
        );
        let report = settled_memory(&a).await?;
        assert!(
            report.models.iter().any(|m| m.name == MODEL),
            "Bob unloaded Alice's model: {:?}",
            report.models
        );
        // Alice may.
        a.manager.unload_model(MODEL).await?;
        Ok(())
    })
}
