//! How deep a compiler that recurses along a graph's edges can go: an upper bound on the
//! longest path, cycles included, for a compiler that enters each vertex at most once per path
//! (llguidance marks a rule or a `$ref` as in progress before it recurses into it).
//!
//! A path through a cycle visits each of the cycle's vertices at most once, so a strongly
//! connected component costs at most the sum of its vertices' costs. The components (Tarjan's
//! algorithm) come out in an order where every component follows all those it reaches, so one
//! pass over them gives each vertex its bound. Everything here is iterative: the point is to
//! bound recursion, so this code must not recurse.

/// A directed graph whose vertices and edges cost depth.
#[derive(Debug, Default)]
pub(super) struct Graph {
    /// Per vertex: the depth a path that ends at it adds.
    height: Vec<usize>,
    /// Per vertex: what passing through it adds when it lies on a cycle.
    cycle_cost: Vec<usize>,
    /// Per vertex: its out-edges, `(target, depth the edge adds)`.
    edges: Vec<Vec<(usize, usize)>>,
}

const UNSEEN: usize = usize::MAX;

impl Graph {
    /// Adds a vertex and returns its index.
    pub fn add_vertex(&mut self, height: usize, cycle_cost: usize) -> usize {
        self.height.push(height);
        self.cycle_cost.push(cycle_cost);
        self.edges.push(Vec::new());
        self.height.len() - 1
    }

    /// Adds an edge from `from` to `to` (both indices from [`Graph::add_vertex`]).
    pub fn add_edge(&mut self, from: usize, to: usize, weight: usize) {
        self.edges[from].push((to, weight));
    }

    /// For every vertex, a bound on the depth of any path that starts there and enters no vertex
    /// twice: a vertex outside cycles adds the most of its height and its edges' weight plus
    /// what follows; a cycle adds the sum of its vertices' cycle costs plus its largest height
    /// plus the most any edge out of it leads to.
    pub fn depths(&self) -> Vec<usize> {
        let n = self.height.len();
        let mut index = vec![UNSEEN; n];
        let mut low = vec![0; n];
        let mut on_stack = vec![false; n];
        let mut component = vec![UNSEEN; n];
        let mut component_depth: Vec<usize> = Vec::new();
        let mut stack = Vec::new();
        // The recursion of Tarjan's algorithm: (vertex, next out-edge to look at).
        let mut calls: Vec<(usize, usize)> = Vec::new();
        let mut next_index = 0;
        for root in 0..n {
            if index[root] != UNSEEN {
                continue;
            }
            index[root] = next_index;
            low[root] = next_index;
            next_index += 1;
            stack.push(root);
            on_stack[root] = true;
            calls.push((root, 0));
            while let Some(&(v, edge)) = calls.last() {
                if let Some(&(w, _)) = self.edges[v].get(edge) {
                    if let Some(call) = calls.last_mut() {
                        call.1 += 1;
                    }
                    if index[w] == UNSEEN {
                        index[w] = next_index;
                        low[w] = next_index;
                        next_index += 1;
                        stack.push(w);
                        on_stack[w] = true;
                        calls.push((w, 0));
                    } else if on_stack[w] {
                        low[v] = low[v].min(index[w]);
                    }
                    continue;
                }
                calls.pop();
                if let Some(&(parent, _)) = calls.last() {
                    low[parent] = low[parent].min(low[v]);
                }
                if low[v] == index[v] {
                    let id = component_depth.len();
                    let mut members = Vec::new();
                    while let Some(w) = stack.pop() {
                        on_stack[w] = false;
                        component[w] = id;
                        members.push(w);
                        if w == v {
                            break;
                        }
                    }
                    let depth = self.component_depth(&members, id, &component, &component_depth);
                    component_depth.push(depth);
                }
            }
        }
        component.iter().map(|&c| component_depth[c]).collect()
    }

    /// The bound for component `id` (its `members`), every component it reaches already done.
    fn component_depth(
        &self,
        members: &[usize],
        id: usize,
        component: &[usize],
        done: &[usize],
    ) -> usize {
        let out = members.iter().flat_map(|&v| self.edges[v].iter());
        if let [v] = members
            && !self.edges[*v].iter().any(|&(w, _)| w == *v)
        {
            let below = out.map(|&(w, weight)| weight.saturating_add(done[component[w]]));
            return below.fold(self.height[*v], usize::max);
        }
        let exits = out.filter(|&&(w, _)| component[w] != id);
        let below = exits
            .map(|&(w, weight)| weight.saturating_add(done[component[w]]))
            .max()
            .unwrap_or(0);
        let cycle: usize = members.iter().map(|&v| self.cycle_cost[v]).sum();
        let tallest = members.iter().map(|&v| self.height[v]).max().unwrap_or(0);
        cycle.saturating_add(tallest).saturating_add(below)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// How deep llguidance's Lark compiler goes from `start` over unit-cost `edges`: it enters a
    /// rule once (a rule in progress or done is not entered again) and its references in order.
    fn compiler_depth(n: usize, edges: &[Vec<usize>], start: usize) -> usize {
        let mut entered = vec![false; n];
        let mut stack = vec![(start, 0)];
        entered[start] = true;
        let mut deepest = 1;
        while let Some((v, i)) = stack.pop() {
            let Some(&w) = edges[v].get(i) else {
                continue;
            };
            stack.push((v, i + 1));
            if !entered[w] {
                entered[w] = true;
                stack.push((w, 0));
                deepest = deepest.max(stack.len());
            }
        }
        deepest
    }

    proptest! {
        /// The bound holds whatever order the compiler takes the references in.
        #[test]
        fn the_bound_is_never_below_what_a_compiler_reaches(
            n in 1usize..12,
            raw in prop::collection::vec((0usize..12, 0usize..12), 0..40),
        ) {
            let mut edges = vec![Vec::new(); n];
            let mut g = Graph::default();
            for _ in 0..n {
                g.add_vertex(1, 1);
            }
            for (a, b) in raw {
                let (a, b) = (a % n, b % n);
                edges[a].push(b);
                g.add_edge(a, b, 1);
            }
            let bound = g.depths();
            for (start, &bound) in bound.iter().enumerate() {
                prop_assert!(bound >= compiler_depth(n, &edges, start));
            }
        }
    }

    /// A graph of `n` unit vertices, each pointing at the next; `back` adds an edge from the
    /// last to the first.
    fn chain(n: usize, back: bool) -> Graph {
        let mut g = Graph::default();
        for _ in 0..n {
            g.add_vertex(1, 1);
        }
        for v in 1..n {
            g.add_edge(v - 1, v, 1);
        }
        if back {
            g.add_edge(n - 1, 0, 1);
        }
        g
    }

    #[test]
    fn a_chain_is_as_deep_as_it_is_long_from_each_vertex() {
        assert_eq!(chain(5, false).depths(), [5, 4, 3, 2, 1]);
    }

    #[test]
    fn a_cycle_costs_each_of_its_vertices_once_and_more_for_the_way_in() {
        // The five vertices once, plus the tallest height for the vertex the path enters by.
        assert_eq!(chain(5, true).depths(), [6; 5]);
    }

    #[test]
    fn a_vertex_that_points_at_itself_is_a_cycle() {
        let mut g = Graph::default();
        let v = g.add_vertex(3, 2);
        g.add_edge(v, v, 3);
        assert_eq!(g.depths(), [5]);
    }

    #[test]
    fn edges_weigh_what_they_add_and_the_deepest_branch_wins() {
        let mut g = Graph::default();
        let root = g.add_vertex(1, 1);
        let shallow = g.add_vertex(1, 1);
        let deep = g.add_vertex(10, 10);
        g.add_edge(root, shallow, 5);
        g.add_edge(root, deep, 2);
        assert_eq!(g.depths()[root], 12);
    }

    #[test]
    fn a_cycle_in_the_middle_of_a_chain_adds_what_follows_it() {
        // 0 → (1 ⇄ 2) → 3 → 4
        let mut g = chain(5, false);
        g.add_edge(2, 1, 1);
        let d = g.depths();
        assert_eq!(d[3], 2);
        assert_eq!(d[1], 2 + 1 + 1 + 2);
        assert_eq!(d[0], 1 + d[1]);
    }

    #[test]
    fn a_long_chain_is_measured_without_recursing() {
        // Deeper than any thread's stack would allow a recursive walk.
        let d = chain(1_000_000, true).depths();
        assert_eq!(d[0], 1_000_001);
    }
}
