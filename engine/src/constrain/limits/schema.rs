//! How deep llguidance recurses compiling a JSON Schema: one level per nested object or array
//! of the schema, and through each `$ref` into its target, which it compiles in place the first
//! time it meets that `$ref` string (a target is compiled once per distinct string).
//!
//! The bound is the longest path through a graph of two kinds of vertices: a *resource* per
//! distinct `$ref` string (the document root is one too), and a *node* per object or array a
//! resource may resolve to. A resource leads to its nodes; a node leads to the resource of every
//! `$ref` in its subtree, the edge weighing how deep below the node that `$ref` sits. Where a
//! `$ref` could resolve to several nodes (`$id` bases, anchors) it leads to all of them, so the
//! bound never falls short of what llguidance does; see [`super::graph`] for cycles.

use std::collections::HashMap;

use serde_json::Value;

use super::graph::Graph;

/// What [`measure`] finds.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Shape {
    /// Objects and arrays nested in each other, at most (the root is 1).
    pub nesting: usize,
    /// Distinct `$ref` strings, and objects with an `$id` or an anchor (what a `$ref` may
    /// resolve against: the graph [`depth`] builds grows with both).
    pub refs: usize,
}

/// The objects and arrays of a document in preorder, with where the `$ref`s, `$id`s and anchors
/// are.
struct Tree<'a> {
    /// Per node: its depth (the root is 1), the size of its subtree and its height.
    depth: Vec<usize>,
    size: Vec<usize>,
    height: Vec<usize>,
    /// Node index by the address of its value.
    by_addr: HashMap<*const Value, usize>,
    /// `(node, string)` of every `"$ref": "string"`, in preorder.
    refs: Vec<(usize, &'a str)>,
    /// `(node, value, $id)` of the objects with an `$id`, bases a `$ref` may resolve against.
    ids: Vec<(usize, &'a Value, &'a str)>,
    /// `(node, name)` of the objects with an `$anchor` or a `$dynamicAnchor`.
    anchors: Vec<(usize, &'a str)>,
}

impl<'a> Tree<'a> {
    fn new(root: &'a Value) -> Tree<'a> {
        let mut t = Tree {
            depth: Vec::new(),
            size: Vec::new(),
            height: Vec::new(),
            by_addr: HashMap::new(),
            refs: Vec::new(),
            ids: Vec::new(),
            anchors: Vec::new(),
        };
        let mut parent = Vec::new();
        let mut todo: Vec<(&Value, Option<usize>)> = vec![(root, None)];
        while let Some((value, up)) = todo.pop() {
            let children: Vec<&Value> = match value {
                Value::Object(map) => map.values().collect(),
                Value::Array(items) => items.iter().collect(),
                _ => continue,
            };
            let node = t.depth.len();
            t.depth.push(up.map_or(1, |p| t.depth[p] + 1));
            t.size.push(1);
            t.height.push(1);
            parent.push(up);
            t.by_addr.insert(std::ptr::from_ref(value), node);
            if let Value::Object(map) = value {
                if let Some(Value::String(s)) = map.get("$ref") {
                    t.refs.push((node, s.as_str()));
                }
                // `id` is draft 4's `$id`; an `$id` with a fragment (draft 7) names an anchor.
                for key in ["$id", "id"] {
                    if let Some(Value::String(id)) = map.get(key) {
                        t.ids.push((node, value, id.as_str()));
                        if let Some((_, name)) = id.split_once('#') {
                            t.anchors.push((node, name));
                        }
                    }
                }
                for key in ["$anchor", "$dynamicAnchor"] {
                    if let Some(Value::String(name)) = map.get(key) {
                        t.anchors.push((node, name.as_str()));
                    }
                }
            }
            // Reversed, so that children are numbered in order: a subtree is a range.
            todo.extend(children.into_iter().rev().map(|c| (c, Some(node))));
        }
        for node in (1..t.depth.len()).rev() {
            if let Some(p) = parent[node] {
                t.size[p] += t.size[node];
                t.height[p] = t.height[p].max(t.height[node] + 1);
            }
        }
        t
    }

    /// The nodes `reference` may resolve to: its document is the root or an `$id` whose last
    /// path segment is the reference's (the root and every `$id` where either has none); its
    /// fragment a JSON pointer from there, or an anchor of that name anywhere.
    fn targets(&self, root: &'a Value, reference: &str) -> Vec<usize> {
        let (uri, fragment) = reference.split_once('#').unwrap_or((reference, ""));
        let wanted = last_segment(uri);
        let same_document = |id: &str| match (&wanted, last_segment(id)) {
            (Some(a), Some(b)) => *a == b,
            _ => true,
        };
        // An empty URI is the document the `$ref` is in: the root, or any `$id` around it. The
        // root without an `$id` is `json-schema:///`, which names no document either.
        let mut bases: Vec<(usize, &Value)> = Vec::new();
        if uri.is_empty() || wanted.is_none() {
            bases.push((0, root));
        }
        let ids = self
            .ids
            .iter()
            .filter(|(_, _, id)| uri.is_empty() || same_document(id));
        bases.extend(ids.map(|&(node, value, _)| (node, value)));
        let mut out: Vec<usize> = Vec::new();
        if fragment.is_empty() {
            out.extend(bases.iter().map(|&(node, _)| node));
        } else if fragment.starts_with('/') {
            for (_, base) in bases {
                if let Some(v) = pointer(base, fragment) {
                    out.extend(self.by_addr.get(&std::ptr::from_ref(v)));
                }
            }
        } else {
            let name = percent_decode(fragment);
            let named = self.anchors.iter().filter(|(_, a)| *a == name);
            out.extend(named.map(|&(node, _)| node));
        }
        out.sort_unstable();
        out.dedup();
        out
    }
}

/// The last path segment of a URI (percent-decoded, without query or fragment), `None` where it says
/// nothing about which document is meant (empty, `.`, `..`).
fn last_segment(uri: &str) -> Option<String> {
    let path = uri.split(['?', '#']).next().unwrap_or_default();
    let last = percent_decode(path.rsplit('/').next().unwrap_or_default());
    (!matches!(last.as_str(), "" | "." | "..")).then_some(last)
}

/// Resolves a JSON pointer (`/a/b~1c/0`, percent-encoded as in a URI fragment) from `base`.
fn pointer<'v>(base: &'v Value, fragment: &str) -> Option<&'v Value> {
    if fragment.is_empty() {
        return Some(base);
    }
    let mut v = base;
    for raw in fragment.strip_prefix('/')?.split('/') {
        let token = percent_decode(raw).replace("~1", "/").replace("~0", "~");
        v = match v {
            Value::Object(map) => map.get(&token)?,
            Value::Array(items) => items.get(token.parse::<usize>().ok()?)?,
            _ => return None,
        };
    }
    Some(v)
}

/// `%XX` escapes decoded; anything malformed is kept as it is.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok());
        match hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
            Some(b) if bytes[i] == b'%' => {
                out.push(b);
                i += 3;
            }
            _ => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The nesting and the distinct `$ref`s of `root`: cheap, and enough to refuse before
/// [`depth`] builds its graph.
pub(super) fn measure(root: &Value) -> Shape {
    let tree = Tree::new(root);
    let mut refs: Vec<&str> = tree.refs.iter().map(|&(_, s)| s).collect();
    refs.sort_unstable();
    refs.dedup();
    Shape {
        nesting: tree.height.first().copied().unwrap_or(0),
        refs: refs.len() + tree.ids.len() + tree.anchors.len(),
    }
}

/// A bound on how deep llguidance recurses compiling `root`, in nested objects and arrays
/// (the module doc says how).
pub(super) fn depth(root: &Value) -> usize {
    let tree = Tree::new(root);
    if tree.depth.is_empty() {
        return 0;
    }
    let mut graph = Graph::default();
    // The root (node 0) is a resource, then each distinct `$ref` string.
    let mut resources: HashMap<&str, usize> = HashMap::new();
    let mut node_vertex: HashMap<usize, usize> = HashMap::new();
    let mut add_resource = |graph: &mut Graph, targets: Vec<usize>| {
        // On a cycle a resource adds at most its tallest target.
        let tallest = targets.iter().map(|&n| tree.height[n]).max().unwrap_or(0);
        let resource = graph.add_vertex(tallest, tallest);
        for node in targets {
            let vertex = *node_vertex
                .entry(node)
                .or_insert_with(|| graph.add_vertex(tree.height[node], 0));
            graph.add_edge(resource, vertex, 0);
        }
        resource
    };
    let root_resource = add_resource(&mut graph, vec![0]);
    for &(_, reference) in &tree.refs {
        if !resources.contains_key(reference) {
            let vertex = add_resource(&mut graph, tree.targets(root, reference));
            resources.insert(reference, vertex);
        }
    }
    for (&node, &vertex) in &node_vertex {
        // The `$ref`s in the subtree of `node` (a preorder range).
        let end = node + tree.size[node];
        let first = tree.refs.partition_point(|&(n, _)| n < node);
        let mut out: HashMap<usize, usize> = HashMap::new();
        for &(site, reference) in tree.refs[first..].iter().take_while(|&&(n, _)| n < end) {
            let weight = tree.depth[site] - tree.depth[node] + 1;
            let target = resources[reference];
            let w = out.entry(target).or_insert(0);
            *w = (*w).max(weight);
        }
        for (target, weight) in out {
            graph.add_edge(vertex, target, weight);
        }
    }
    graph.depths()[root_resource]
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// `n` definitions, each an object whose property `a` refers to the next (the issue's
    /// reproducer at 600).
    fn ref_chain(n: usize) -> Value {
        let mut defs = serde_json::Map::new();
        for i in 0..n {
            let next = json!({"$ref": format!("#/$defs/d{}", i + 1)});
            let d = if i + 1 < n {
                json!({"type": "object", "properties": {"a": next}})
            } else {
                json!({"type": "integer"})
            };
            defs.insert(format!("d{i}"), d);
        }
        json!({"$defs": defs, "$ref": "#/$defs/d0"})
    }

    #[test]
    fn a_plain_schema_is_as_deep_as_it_nests() {
        let s = json!({"type": "object", "properties": {"a": {"type": "array", "items": {}}}});
        assert_eq!(depth(&s), 4);
        assert_eq!(
            measure(&s),
            Shape {
                nesting: 4,
                refs: 0
            }
        );
    }

    #[test]
    fn each_link_of_a_ref_chain_adds_how_deep_its_ref_sits() {
        // 3 per link: the definition, `properties` and `a`.
        let (d100, d200) = (depth(&ref_chain(100)), depth(&ref_chain(200)));
        assert_eq!(d200 - d100, 300);
        // 1 + 3 × 599 + 1, or 1 more: the root's subtree holds the definitions, and the bound
        // does not know that llguidance compiles `$defs` only through `$ref`s.
        assert!((1799..=1800).contains(&depth(&ref_chain(600))));
        assert_eq!(measure(&ref_chain(600)).refs, 599 + 1);
    }

    #[test]
    fn a_recursive_schema_is_bounded_by_its_cycle() {
        let tree = json!({
            "$defs": {"node": {"type": "object", "properties": {
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
            "$ref": "#/$defs/node"
        });
        let d = depth(&tree);
        assert!((4..=16).contains(&d), "{d}");
    }

    #[test]
    fn aliases_of_one_target_count_once_each() {
        // llguidance compiles a target once per distinct `$ref` string: a definition that
        // refers to itself under k spellings recurses k times.
        let with = |spellings: &[&str]| {
            let props: serde_json::Map<String, Value> = spellings
                .iter()
                .enumerate()
                .map(|(i, s)| (format!("p{i}"), json!({"$ref": s})))
                .collect();
            json!({"$defs": {"a": {"type": "object", "properties": props}}, "$ref": "#/$defs/a"})
        };
        let one = depth(&with(&["#/$defs/a"]));
        let three = depth(&with(&["#/$defs/a", "#/%24defs/a", "#/$defs/%61"]));
        assert!(three >= one + 2 * 3, "{one} {three}");
    }

    #[test]
    fn refs_through_an_id_base_or_an_anchor_are_followed() {
        // The root refers to `x`; deep inside `x`, a `$ref` in some spelling refers to `y`, two
        // arrays deep: following it goes deeper than the document nests.
        let doc = |via: &str| {
            let p = json!({"type": "array", "items": {"type": "array", "items": {"$ref": via}}});
            json!({"$defs": {
                "x": {"$id": "http://example.com/s/x.json", "$anchor": "ax",
                      "$defs": {"y": {"$id": "y.json#ay", "type": "array",
                                      "items": {"type": "array", "items": {}}}},
                      "type": "object", "properties": {"p": p}},
                "other": {"$id": "http://example.com/s/other.json", "type": "integer"}},
                "$ref": "#/$defs/x"})
        };
        let unresolved = depth(&doc("#/nothing"));
        for via in [
            "#/$defs/y",
            "y.json",
            "http://example.com/s/y.json#",
            "#ay",
            "x.json#/$defs/y",
        ] {
            // Through `y`: its two arrays and their items schema.
            assert!(depth(&doc(via)) >= unresolved + 2, "{via}");
        }
        // Another document's name (one level: `other` is an integer) or an unknown anchor
        // does not lead to `y`.
        assert_eq!(depth(&doc("other.json")), unresolved + 1);
        assert_eq!(depth(&doc("#nowhere")), unresolved);
    }

    #[test]
    fn a_last_path_segment_names_a_document_when_it_can() {
        assert_eq!(
            last_segment("http://e.com/a/b%2Ejson?q=1").as_deref(),
            Some("b.json")
        );
        assert_eq!(last_segment("urn:x:y").as_deref(), Some("urn:x:y"));
        for vague in ["", "http://e.com/a/", ".", "../.."] {
            assert_eq!(last_segment(vague), None, "{vague}");
        }
    }

    #[test]
    fn a_pointer_decodes_percent_and_tilde_escapes() {
        let doc = json!({"a/b": {"c~d": [0, {"$x": 1}]}});
        assert_eq!(pointer(&doc, "/a~1b/c~0d/1/%24x"), Some(&json!(1)));
        assert_eq!(pointer(&doc, "/a~1b/nope"), None);
        assert_eq!(pointer(&doc, ""), Some(&doc));
        assert_eq!(percent_decode("%zz%4"), "%zz%4");
    }

    #[test]
    fn scalars_and_booleans_have_no_depth() {
        assert_eq!(depth(&json!(true)), 0);
        assert_eq!(
            measure(&json!(1)),
            Shape {
                nesting: 0,
                refs: 0
            }
        );
    }
}
