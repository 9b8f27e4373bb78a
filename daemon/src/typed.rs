//! Argument types checked before a call reaches an interface. The contract answers bad
//! arguments with `InvalidArgument`; zbus's generated dispatch would answer a body of the wrong
//! type itself, under its own error name, before any of the daemon's code runs. [`Typed`] wraps
//! an interface, learns each method's argument signature from the interface's own
//! introspection (so the method definitions stay the one place that states them), and answers
//! a mismatch before the wrapped dispatch sees it.

use std::collections::HashMap;

use async_trait::async_trait;
use leanstream::contract::LeanStreamError;
use zbus::names::{InterfaceName, MemberName};
use zbus::object_server::{DispatchResult2, Interface, SignalEmitter};
use zbus::zvariant::{OwnedValue, Signature, Value};
use zbus::{Connection, ObjectServer, fdo, message};

/// An interface whose methods refuse arguments of the wrong type with `InvalidArgument`.
pub struct Typed<I> {
    inner: I,
    /// Method name → the signature its arguments must have.
    inputs: HashMap<String, Signature>,
}

impl<I: Interface> Typed<I> {
    pub fn new(inner: I) -> Typed<I> {
        let mut xml = String::new();
        inner.introspect_to_writer(&mut xml, 0);
        let inputs = input_signatures(&xml)
            .into_iter()
            .filter_map(|(name, sig)| Some((name, Signature::try_from(sig.as_str()).ok()?)))
            .collect();
        Typed { inner, inputs }
    }

    /// The refusal for a call to `name` whose body does not have the method's signature; `None`
    /// where it does, or where `name` is not a method (zbus answers unknown methods itself).
    fn refusal<'c>(
        &self,
        connection: &'c Connection,
        msg: &'c message::Message,
        name: &MemberName<'_>,
    ) -> Option<DispatchResult2<'c>> {
        let want = self.inputs.get(name.as_str())?;
        let body = msg.body();
        let got = body.signature();
        if got == want {
            return None;
        }
        let error = LeanStreamError::InvalidArgument(format!(
            "{name} takes arguments of type ({}), not ({})",
            want.to_string_no_parens(),
            got.to_string_no_parens()
        ));
        Some(DispatchResult2::new_async(connection, msg, async move {
            Err::<(), _>(error)
        }))
    }
}

#[async_trait]
impl<I: Interface> Interface for Typed<I> {
    fn name() -> InterfaceName<'static> {
        I::name()
    }

    fn spawn_tasks_for_methods(&self) -> bool {
        self.inner.spawn_tasks_for_methods()
    }

    async fn get(
        &self,
        property_name: &str,
        server: &ObjectServer,
        connection: &Connection,
        header: Option<&message::Header<'_>>,
        emitter: &SignalEmitter<'_>,
    ) -> Option<fdo::Result<OwnedValue>> {
        self.inner
            .get(property_name, server, connection, header, emitter)
            .await
    }

    async fn get_all(
        &self,
        server: &ObjectServer,
        connection: &Connection,
        header: Option<&message::Header<'_>>,
        emitter: &SignalEmitter<'_>,
    ) -> fdo::Result<HashMap<String, OwnedValue>> {
        self.inner
            .get_all(server, connection, header, emitter)
            .await
    }

    fn set<'call>(
        &'call self,
        property_name: &'call str,
        value: &'call Value<'_>,
        server: &'call ObjectServer,
        connection: &'call Connection,
        header: Option<&'call message::Header<'_>>,
        emitter: &'call SignalEmitter<'_>,
    ) -> DispatchResult2<'call> {
        self.inner
            .set(property_name, value, server, connection, header, emitter)
    }

    async fn set_mut(
        &mut self,
        property_name: &str,
        value: &Value<'_>,
        server: &ObjectServer,
        connection: &Connection,
        header: Option<&message::Header<'_>>,
        emitter: &SignalEmitter<'_>,
    ) -> Option<fdo::Result<()>> {
        self.inner
            .set_mut(property_name, value, server, connection, header, emitter)
            .await
    }

    fn call<'call>(
        &'call self,
        server: &'call ObjectServer,
        connection: &'call Connection,
        msg: &'call message::Message,
        name: MemberName<'call>,
    ) -> DispatchResult2<'call> {
        match self.refusal(connection, msg, &name) {
            Some(refused) => refused,
            None => self.inner.call(server, connection, msg, name),
        }
    }

    fn call_mut<'call>(
        &'call mut self,
        server: &'call ObjectServer,
        connection: &'call Connection,
        msg: &'call message::Message,
        name: MemberName<'call>,
    ) -> DispatchResult2<'call> {
        match self.refusal(connection, msg, &name) {
            Some(refused) => refused,
            None => self.inner.call_mut(server, connection, msg, name),
        }
    }

    fn introspect_to_writer(&self, writer: &mut dyn std::fmt::Write, level: usize) {
        self.inner.introspect_to_writer(writer, level)
    }
}

/// Each method's argument signature (its `in` arguments' types, in order) from an interface's
/// introspection XML as zbus writes it: one element per line, `<method name="…">`, then
/// `<arg … type="…" direction="in"/>` lines, then `</method>`.
fn input_signatures(xml: &str) -> HashMap<String, String> {
    let mut methods = HashMap::new();
    let mut current: Option<(String, String)> = None;
    for line in xml.lines().map(str::trim) {
        if let Some(name) = attribute(line, "<method ", "name") {
            current = Some((name.to_string(), String::new()));
        } else if line.starts_with("</method>") {
            if let Some((name, sig)) = current.take() {
                methods.insert(name, sig);
            }
        } else if let Some((_, sig)) = current.as_mut()
            && attribute(line, "<arg ", "direction") == Some("in")
            && let Some(ty) = attribute(line, "<arg ", "type")
        {
            sig.push_str(ty);
        }
    }
    methods
}

/// The value of attribute `attr` in `line`, where `line` is an element starting with `element`.
fn attribute<'x>(line: &'x str, element: &str, attr: &str) -> Option<&'x str> {
    let rest = line.strip_prefix(element)?;
    let start = rest
        .find(&format!(" {attr}=\""))
        .map(|i| i + attr.len() + 3);
    let start = start.or_else(|| {
        rest.starts_with(&format!("{attr}=\""))
            .then_some(attr.len() + 2)
    })?;
    let len = rest[start..].find('"')?;
    Some(&rest[start..start + len])
}

#[cfg(test)]
mod tests {
    use super::*;

    const XML: &str = r#"<interface name="x.Y">
  <method name="Open">
    <arg name="model" type="s" direction="in"/>
    <arg name="context" type="u" direction="in"/>
    <arg type="o" direction="out"/>
  </method>
  <method name="Version">
    <arg type="s" direction="out"/>
  </method>
  <method name="Generate">
    <arg name="prompt" type="s" direction="in"/>
    <arg name="params" type="(sua{sv})" direction="in"/>
    <arg type="h" direction="out"/>
  </method>
  <signal name="Changed">
    <arg name="what" type="s"/>
  </signal>
</interface>"#;

    #[test]
    fn each_method_gets_its_in_arguments_in_order() {
        let sigs = input_signatures(XML);
        assert_eq!(sigs.len(), 3, "{sigs:?}");
        assert_eq!(sigs["Open"], "su");
        assert_eq!(sigs["Version"], "");
        assert_eq!(sigs["Generate"], "s(sua{sv})");
    }

    struct Probe;

    #[zbus::interface(name = "io.github.leanstream.Probe")]
    impl Probe {
        async fn open(&self, _model: &str, _context: u32) -> String {
            String::new()
        }
        fn version(&self) -> String {
            String::new()
        }
        async fn generate(&self, _params: (String, u32), _options: HashMap<String, OwnedValue>) {}
    }

    /// What zbus's macro writes is read: every method is known, with its arguments in order.
    #[test]
    fn a_generated_interface_is_fully_checked() {
        let typed = Typed::new(Probe);
        let sig = |m: &str| typed.inputs.get(m).map(|s| s.to_string_no_parens());
        assert_eq!(typed.inputs.len(), 3, "{:?}", typed.inputs);
        assert_eq!(sig("Open").as_deref(), Some("su"));
        assert_eq!(sig("Version").as_deref(), Some(""));
        assert_eq!(sig("Generate").as_deref(), Some("(su)a{sv}"));
    }
}
