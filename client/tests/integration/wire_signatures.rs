//! The exact D-Bus signatures of the contract's wire types, as documented in docs/clients.md
//! for C (sd-bus) and Python callers. A change here is a wire-incompatible contract change.

use leanstream::contract::{
    ChatTurn, ClientMemory, GenerateParams, MemoryReport, ModelInfo, ModelMemory, SessionMemory,
    SessionStats,
};
use zbus::zvariant::Type;

fn sig<T: Type>() -> String {
    T::SIGNATURE.to_string()
}

#[test]
fn wire_types_have_the_documented_signatures() {
    assert_eq!(sig::<ModelInfo>(), "(sssstb)");
    assert_eq!(sig::<Vec<ModelInfo>>(), "a(sssstb)");
    // Generation options are a dictionary, so that a key can be added without breaking callers.
    assert_eq!(sig::<GenerateParams>(), "a{sv}");
    assert_eq!(sig::<ChatTurn>(), "(ss)");
    assert_eq!(sig::<Vec<ChatTurn>>(), "a(ss)");
    assert_eq!(sig::<ModelMemory>(), "(sttttsttx(tttttt))");
    assert_eq!(sig::<SessionMemory>(), "(osst)");
    assert_eq!(sig::<ClientMemory>(), "(sut)");
    assert_eq!(
        sig::<MemoryReport>(),
        "(ttta(sttttsttx(tttttt))a(osst)a(sut))"
    );
    assert_eq!(sig::<SessionStats>(), "(suuutttt)");
}
