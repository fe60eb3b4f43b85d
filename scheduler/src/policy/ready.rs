//! An ordered index of vGPUs: the building block policies use to find the next vGPU in
//! O(log n) instead of scanning every vGPU on every decision.

use std::collections::BTreeSet;

use crate::model::VgpuId;

/// vGPUs ordered by a policy-chosen key; ties go to the lower id. Each vGPU is in the index at
/// most once.
#[derive(Debug, Clone)]
pub struct ReadySet<K: Ord + Copy> {
    order: BTreeSet<(K, VgpuId)>,
    keys: Vec<Option<K>>,
}

impl<K: Ord + Copy> Default for ReadySet<K> {
    fn default() -> Self {
        ReadySet {
            order: BTreeSet::new(),
            keys: Vec::new(),
        }
    }
}

impl<K: Ord + Copy> ReadySet<K> {
    /// Puts `vgpu` in the index under `key`, replacing its old key.
    pub fn insert(&mut self, vgpu: VgpuId, key: K) {
        self.remove(vgpu);
        let i = vgpu.index();
        if self.keys.len() <= i {
            self.keys.resize(i + 1, None);
        }
        self.keys[i] = Some(key);
        self.order.insert((key, vgpu));
    }

    /// Takes `vgpu` out of the index; returns its key if it was in.
    pub fn remove(&mut self, vgpu: VgpuId) -> Option<K> {
        let key = self.keys.get_mut(vgpu.index())?.take()?;
        self.order.remove(&(key, vgpu));
        Some(key)
    }

    /// The key of `vgpu`, if it is in the index.
    pub fn key(&self, vgpu: VgpuId) -> Option<K> {
        self.keys.get(vgpu.index()).copied().flatten()
    }

    /// True if `vgpu` is in the index.
    pub fn contains(&self, vgpu: VgpuId) -> bool {
        self.key(vgpu).is_some()
    }

    /// The vGPU with the smallest key.
    pub fn first(&self) -> Option<(K, VgpuId)> {
        self.order.first().copied()
    }

    /// All entries, smallest key first.
    pub fn iter(&self) -> impl Iterator<Item = (K, VgpuId)> + '_ {
        self.order.iter().copied()
    }

    /// The number of vGPUs in the index.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// True if the index is empty.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn orders_by_key_then_id_and_replaces_keys() {
        let mut s = ReadySet::default();
        s.insert(VgpuId(3), 5u64);
        s.insert(VgpuId(1), 5);
        s.insert(VgpuId(2), 7);
        assert_eq!(s.first(), Some((5, VgpuId(1))));
        s.insert(VgpuId(1), 9);
        assert_eq!(s.first(), Some((5, VgpuId(3))));
        assert_eq!(s.len(), 3);
        assert_eq!(s.remove(VgpuId(3)), Some(5));
        assert_eq!(s.remove(VgpuId(3)), None);
        assert_eq!(s.remove(VgpuId(40)), None);
        let order: Vec<_> = s.iter().map(|(_, v)| v).collect();
        assert_eq!(order, vec![VgpuId(2), VgpuId(1)]);
    }
}
