//! CUDA graphs in the guest, pure logic: nodes with the work they stand for ([`Op`]), their
//! dependencies, and the order a launch issues them in. A graph runs on one stream of the
//! host's in-order executor: its nodes are issued in a topological order, which honours every
//! dependency (a node is issued after all it depends on, and the stream runs work in order).
//! `api_graph.rs` holds the C entry points, stream capture and the issuing of each node.

use std::collections::BTreeSet;

use crate::array::Copy3D;
use crate::driver::{CuResult, LaunchParams};
use crate::status::{CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_OUT_OF_MEMORY};

/// Nodes one graph may hold: the guest's bookkeeping of a graph is host memory of this
/// process, and a graph of more nodes than this is a runaway loop, not a workload (the
/// samples' largest graphs have a few hundred).
pub const MAX_NODES: usize = 1 << 16;
/// Nesting of child graphs: issuing a graph walks its children recursively.
pub const MAX_DEPTH: usize = 16;

/// `CUhostFn`.
pub type HostFn = unsafe extern "C" fn(*mut std::ffi::c_void);

/// What a node does when the graph runs. Handles (`ctx`, `function`, `event`) are the
/// driver's.
#[derive(Debug, Clone)]
pub enum Op {
    Kernel {
        ctx: u64,
        function: u64,
        grid: [u32; 3],
        block: [u32; 3],
        shared: u32,
        params: LaunchParams,
        /// A cooperative launch (`cuLaunchCooperativeKernel`).
        cooperative: bool,
    },
    /// A copy as `cuMemcpy3D` describes it (linear memory, arrays, host memory).
    Copy {
        copy: Copy3D,
    },
    /// `width` elements of `element_size` bytes set to `value`, in `height` rows `pitch`
    /// bytes apart.
    Memset {
        dst: u64,
        pitch: usize,
        value: u32,
        element_size: u64,
        width: usize,
        height: usize,
    },
    Host {
        func: HostFn,
        data: usize,
    },
    Empty,
    EventRecord {
        ctx: u64,
        event: u64,
    },
    EventWait {
        event: u64,
    },
    /// A child graph, by the handle of the graph the node owns.
    Child(u64),
    /// A child graph inlined into an executable graph: its nodes in issue order.
    Inline(Vec<Op>),
    /// A graph allocation: its memory exists from the node's creation until the last graph
    /// holding the node is destroyed, so every launch finds it at the address given out.
    MemAlloc {
        dptr: u64,
        bytes: u64,
    },
    MemFree {
        dptr: u64,
    },
}

impl Op {
    /// `CUgraphNodeType`.
    pub fn kind(&self) -> i32 {
        match self {
            Op::Kernel { .. } => 0,
            Op::Copy { .. } => 1,
            Op::Memset { .. } => 2,
            Op::Host { .. } => 3,
            Op::Child(_) | Op::Inline(_) => 4,
            Op::Empty => 5,
            Op::EventWait { .. } => 6,
            Op::EventRecord { .. } => 7,
            Op::MemAlloc { .. } => 10,
            Op::MemFree { .. } => 11,
        }
    }
}

#[derive(Debug, Clone)]
struct Node {
    op: Op,
    /// Nodes this one depends on.
    deps: BTreeSet<usize>,
}

/// A graph: nodes by index (a destroyed node leaves a hole, so indices stay stable) and
/// their dependencies, always acyclic.
#[derive(Debug, Clone, Default)]
pub struct Graph {
    nodes: Vec<Option<Node>>,
}

impl Graph {
    fn node(&self, i: usize) -> CuResult<&Node> {
        self.nodes
            .get(i)
            .and_then(Option::as_ref)
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    fn node_mut(&mut self, i: usize) -> CuResult<&mut Node> {
        self.nodes
            .get_mut(i)
            .and_then(Option::as_mut)
            .ok_or(CUDA_ERROR_INVALID_VALUE)
    }

    pub fn contains(&self, i: usize) -> bool {
        self.node(i).is_ok()
    }

    /// Adds a node after `deps` (existing, distinct nodes of this graph).
    pub fn add(&mut self, op: Op, deps: &[usize]) -> CuResult<usize> {
        if self.nodes.len() >= MAX_NODES {
            eprintln!("vgpu libcuda: a graph reached its limit of {MAX_NODES} nodes");
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let mut set = BTreeSet::new();
        for &d in deps {
            self.node(d)?;
            if !set.insert(d) {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
        }
        self.nodes.push(Some(Node { op, deps: set }));
        Ok(self.nodes.len() - 1)
    }

    pub fn op(&self, i: usize) -> CuResult<&Op> {
        self.node(i).map(|n| &n.op)
    }

    pub fn op_mut(&mut self, i: usize) -> CuResult<&mut Op> {
        self.node_mut(i).map(|n| &mut n.op)
    }

    /// The nodes, in index order.
    pub fn nodes(&self) -> Vec<usize> {
        (0..self.nodes.len())
            .filter(|&i| self.contains(i))
            .collect()
    }

    pub fn roots(&self) -> Vec<usize> {
        self.nodes()
            .into_iter()
            .filter(|&i| self.nodes[i].as_ref().is_some_and(|n| n.deps.is_empty()))
            .collect()
    }

    pub fn dependencies(&self, i: usize) -> CuResult<Vec<usize>> {
        Ok(self.node(i)?.deps.iter().copied().collect())
    }

    pub fn dependents(&self, i: usize) -> CuResult<Vec<usize>> {
        self.node(i)?;
        Ok(self
            .nodes()
            .into_iter()
            .filter(|&j| self.nodes[j].as_ref().is_some_and(|n| n.deps.contains(&i)))
            .collect())
    }

    /// Every edge as (from, to), by destination then source.
    pub fn edges(&self) -> Vec<(usize, usize)> {
        let mut out = Vec::new();
        for to in self.nodes() {
            if let Some(n) = &self.nodes[to] {
                out.extend(n.deps.iter().map(|&from| (from, to)));
            }
        }
        out
    }

    /// Whether `to` can be reached from `from` along edges (a node reaches itself).
    pub fn reaches(&self, from: usize, to: usize) -> bool {
        let mut seen = vec![false; self.nodes.len()];
        let mut todo = vec![to];
        while let Some(n) = todo.pop() {
            if n == from {
                return true;
            }
            if std::mem::replace(&mut seen[n], true) {
                continue;
            }
            if let Some(node) = &self.nodes[n] {
                todo.extend(node.deps.iter().copied());
            }
        }
        false
    }

    /// Adds the edge `from → to`; one that exists already, or that would close a cycle, is
    /// refused.
    pub fn add_edge(&mut self, from: usize, to: usize) -> CuResult<()> {
        self.node(from)?;
        if self.node(to)?.deps.contains(&from) || self.reaches(to, from) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        self.node_mut(to)?.deps.insert(from);
        Ok(())
    }

    pub fn remove_edge(&mut self, from: usize, to: usize) -> CuResult<()> {
        self.node(from)?;
        if !self.node_mut(to)?.deps.remove(&from) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(())
    }

    /// Removes a node and its edges; its op is returned (a child graph's handle, an
    /// allocation, for the caller to release).
    pub fn remove(&mut self, i: usize) -> CuResult<Op> {
        self.node(i)?;
        let node = self.nodes[i].take().ok_or(CUDA_ERROR_INVALID_VALUE)?;
        for n in self.nodes.iter_mut().flatten() {
            n.deps.remove(&i);
        }
        Ok(node.op)
    }

    /// The nodes in an order that puts every node after its dependencies (Kahn's algorithm,
    /// lowest index first among the ready ones: the order they were added in where the
    /// dependencies allow).
    pub fn order(&self) -> Vec<usize> {
        let mut waiting: Vec<usize> = self
            .nodes
            .iter()
            .map(|n| n.as_ref().map_or(0, |n| n.deps.len()))
            .collect();
        let mut ready: BTreeSet<usize> = self.roots().into_iter().collect();
        let mut out = Vec::with_capacity(self.nodes.len());
        let dependents = {
            let mut d = vec![Vec::new(); self.nodes.len()];
            for (from, to) in self.edges() {
                d[from].push(to);
            }
            d
        };
        while let Some(n) = ready.pop_first() {
            out.push(n);
            for &m in &dependents[n] {
                waiting[m] -= 1;
                if waiting[m] == 0 {
                    ready.insert(m);
                }
            }
        }
        out
    }

    /// Whether `other` has the same nodes and edges, each node of the same kind (what
    /// `cuGraphExecUpdate` needs to update in place).
    pub fn same_shape(&self, other: &Graph) -> Result<(), (usize, i32)> {
        const TOPOLOGY_CHANGED: i32 = 2;
        const NODE_TYPE_CHANGED: i32 = 3;
        if self.nodes() != other.nodes() || self.edges() != other.edges() {
            return Err((
                other.nodes().first().copied().unwrap_or(0),
                TOPOLOGY_CHANGED,
            ));
        }
        for i in self.nodes() {
            let (a, b) = (&self.nodes[i], &other.nodes[i]);
            if let (Some(a), Some(b)) = (a, b)
                && a.op.kind() != b.op.kind()
            {
                return Err((i, NODE_TYPE_CHANGED));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_respects_dependencies_and_cycles_are_refused() {
        let mut g = Graph::default();
        let a = g.add(Op::Empty, &[]).unwrap();
        let b = g.add(Op::Empty, &[]).unwrap();
        let c = g.add(Op::Empty, &[a]).unwrap();
        g.add_edge(c, b).unwrap();
        assert_eq!(g.order(), vec![a, c, b]);
        assert_eq!(g.add_edge(b, a), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(g.add_edge(b, b), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(
            g.add_edge(a, c),
            Err(CUDA_ERROR_INVALID_VALUE),
            "an edge twice"
        );
        assert_eq!(g.add(Op::Empty, &[a, a]), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(g.add(Op::Empty, &[9]), Err(CUDA_ERROR_INVALID_VALUE));
        assert_eq!(g.roots(), vec![a]);
        assert_eq!(g.edges(), vec![(c, b), (a, c)]);
        g.remove(c).unwrap();
        assert_eq!(g.roots(), vec![a, b]);
        assert!(g.op(c).is_err());
        assert_eq!(g.order(), vec![a, b]);
    }
}
