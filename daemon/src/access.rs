//! Who may see what in `Memory()`: a caller sees its own sessions and client entry in full, and
//! every other client only as one anonymous total, unless it is root, the daemon's own user, or
//! a member of the configured admin group (`[access] admin_group`).
//!
//! Models are shared and stay visible to everyone: what is loaded and how much the budget holds
//! is what any client needs to plan its requests.

use leanstream::contract::{ClientMemory, MemoryReport};

/// The `client` name under which the other clients' totals are reported.
pub const OTHER_CLIENTS: &str = "(other clients)";

/// Root, the daemon's own user, and members of `admin_group` (primary or supplementary).
pub(crate) fn privileged(uid: u32, admin_group: Option<&str>) -> bool {
    use nix::unistd::{Group, Uid, User, getgrouplist};
    if uid == 0 || Uid::from_raw(uid) == Uid::effective() {
        return true;
    }
    let Some(group) = admin_group.and_then(|g| Group::from_name(g).ok().flatten()) else {
        return false;
    };
    let Ok(Some(user)) = User::from_uid(Uid::from_raw(uid)) else {
        return false;
    };
    let Ok(name) = std::ffi::CString::new(user.name) else {
        return false;
    };
    getgrouplist(&name, user.gid).is_ok_and(|groups| groups.contains(&group.gid))
}

/// `report` as client `viewer` may see it: its own sessions and client entry, the others
/// summed into one [`OTHER_CLIENTS`] entry (session count and bytes), no other session paths.
pub fn redact(mut report: MemoryReport, viewer: &str) -> MemoryReport {
    report.sessions.retain(|s| s.client == viewer);
    let (mine, others): (Vec<ClientMemory>, Vec<ClientMemory>) =
        report.clients.into_iter().partition(|c| c.client == viewer);
    report.clients = mine;
    if !others.is_empty() {
        report.clients.push(ClientMemory {
            client: OTHER_CLIENTS.to_string(),
            sessions: others.iter().map(|c| c.sessions).sum(),
            bytes: others.iter().map(|c| c.bytes).sum(),
        });
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;
    use leanstream::contract::SessionMemory;
    use zbus::zvariant::OwnedObjectPath;

    fn session(id: u32, client: &str, bytes: u64) -> SessionMemory {
        SessionMemory {
            path: OwnedObjectPath::try_from(format!("/s/{id}")).unwrap_or_default(),
            model: "m".into(),
            client: client.into(),
            bytes,
        }
    }

    fn report() -> MemoryReport {
        MemoryReport {
            budget_bytes: 1000,
            used_bytes: 600,
            rss_bytes: 900,
            models: Vec::new(),
            sessions: vec![
                session(1, ":1.1", 10),
                session(2, ":1.2", 20),
                session(3, ":1.3", 40),
            ],
            clients: [(":1.1", 10), (":1.2", 20), (":1.3", 40)]
                .into_iter()
                .map(|(client, bytes)| ClientMemory {
                    client: client.into(),
                    sessions: 1,
                    bytes,
                })
                .collect(),
        }
    }

    #[test]
    fn a_caller_sees_itself_in_full_and_the_others_as_one_total() {
        let seen = redact(report(), ":1.2");
        assert_eq!(seen.sessions, vec![session(2, ":1.2", 20)]);
        let clients: Vec<(&str, u32, u64)> = seen
            .clients
            .iter()
            .map(|c| (c.client.as_str(), c.sessions, c.bytes))
            .collect();
        assert_eq!(clients, [(":1.2", 1, 20), (OTHER_CLIENTS, 2, 50)]);
        // The budget figures are everyone's.
        assert_eq!((seen.budget_bytes, seen.used_bytes), (1000, 600));
        // A caller without sessions sees only the total.
        let seen = redact(report(), ":1.9");
        assert!(seen.sessions.is_empty());
        assert_eq!(seen.clients.len(), 1);
        assert_eq!((seen.clients[0].sessions, seen.clients[0].bytes), (3, 70));
    }

    #[test]
    fn root_the_daemon_user_and_admin_group_members_are_privileged() {
        use nix::unistd::{Group, Uid, User};
        let me = Uid::effective();
        assert!(privileged(0, None));
        assert!(privileged(me.as_raw(), None));
        let Ok(Some(nobody)) = User::from_uid(Uid::from_raw(65534)) else {
            return; // no `nobody` user here
        };
        if nobody.uid == me {
            return;
        }
        assert!(!privileged(65534, None));
        assert!(!privileged(65534, Some("no-such-group-for-leanstream")));
        // Its primary group makes it an admin when that group is the admin group.
        if let Ok(Some(group)) = Group::from_gid(nobody.gid) {
            assert!(privileged(65534, Some(&group.name)), "{}", group.name);
        }
    }
}
