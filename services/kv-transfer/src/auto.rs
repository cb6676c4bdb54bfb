//! The configured transport: `grpc`, a one-sided transport by name (`ucx`), or `auto` (the
//! one-sided transport when an endpoint to the decode node can be made, else the gRPC
//! stream). Counts what each transfer used.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use pdmesh_kv_types::KvLayout;
use pdmesh_proto::v1::KvTarget;

use crate::grpc::GrpcTransport;
use crate::stats::TransferStats;
use crate::transport::{Fabric, TransportKind};
use crate::{Finished, KvPiece, KvSink, KvTransport, StallBound, TransferError};

/// The sending node's transport for its configured kind. A one-sided transfer whose session
/// stalls falls back to the gRPC stream into the same reservation (`Fallback`).
#[derive(Debug)]
pub struct AutoTransport {
    kind: TransportKind,
    /// The one-sided transport and its name.
    remote: Option<(Box<dyn KvTransport>, &'static str)>,
    grpc: Arc<GrpcTransport>,
    stats: Arc<TransferStats>,
}

impl AutoTransport {
    /// `fabric` is what `kind.start` started (None for grpc, or auto without one).
    pub fn new(
        kind: TransportKind,
        fabric: Option<&Arc<dyn Fabric>>,
        stats: Arc<TransferStats>,
    ) -> Self {
        Self::with_stall(kind, fabric, stats, StallBound::default())
    }

    /// `new`, giving up sessions that make no progress within `stall`.
    pub fn with_stall(
        kind: TransportKind,
        fabric: Option<&Arc<dyn Fabric>>,
        stats: Arc<TransferStats>,
        stall: StallBound,
    ) -> Self {
        let grpc = Arc::new(GrpcTransport::new());
        let remote = fabric.map(|f| (f.sender(Arc::clone(&grpc), stall), f.name()));
        Self { kind, remote, grpc, stats }
    }

    /// A one-sided sink that falls back to the stream when it stalls.
    fn fallible(
        &self,
        sink: Box<dyn KvSink>,
        from: &'static str,
        target: &KvTarget,
        prefill_node: &str,
    ) -> Box<dyn KvSink> {
        let layout = target.layout.as_ref().and_then(|l| pdmesh_proto::layout_from_wire(l).ok());
        match layout {
            Some(layout) => Box::new(Fallback {
                remote: Some(sink),
                from,
                kept: Vec::new(),
                stream: None,
                grpc: Arc::clone(&self.grpc),
                target: target.clone(),
                prefill_node: prefill_node.to_string(),
                stats: Arc::clone(&self.stats),
                thin: layout.thin_blocks(target.prompt_tokens as usize),
                layout,
            }),
            // The sink refused such a target already; nothing to fall back with.
            _ => sink,
        }
    }
}

#[async_trait::async_trait]
impl KvTransport for AutoTransport {
    fn name(&self) -> &str {
        self.kind.name()
    }

    async fn open(
        &self,
        target: &KvTarget,
        prefill_node: &str,
    ) -> Result<Box<dyn KvSink>, TransferError> {
        match (&self.kind, &self.remote) {
            (TransportKind::Grpc, _) => self.grpc.open(target, prefill_node).await,
            (TransportKind::Named(_), Some((t, name))) => {
                let sink = t.open(target, prefill_node).await?;
                Ok(self.fallible(sink, name, target, prefill_node))
            }
            (TransportKind::Named(name), None) => Err(TransferError::NoEndpoint {
                node: target.decode_node.clone(),
                reason: format!("{name} is not running on this node"),
            }),
            (TransportKind::Auto, remote) => {
                let (why, wanted) = match remote {
                    Some((t, name)) => match t.open(target, prefill_node).await {
                        Err(TransferError::NoEndpoint { reason, .. }) => (reason, *name),
                        Ok(sink) => return Ok(self.fallible(sink, name, target, prefill_node)),
                        Err(e) => return Err(e),
                    },
                    None => ("no one-sided transport runs on this node".into(), "remote"),
                };
                tracing::debug!(node = target.decode_node, "KV over gRPC: {why}");
                self.stats.fallback(wanted, Fallen::NoEndpoint);
                self.grpc.open(target, prefill_node).await
            }
        }
    }
}

/// Why a transfer did not use the transport it wanted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fallen {
    /// No endpoint could be made (the peer offers none, or refuses this one).
    NoEndpoint,
    /// The session made no progress within its bound.
    Stalled,
}

/// A one-sided transfer that, when its session stalls and the decode node has moved the
/// reservation out of the session's reach, sends the KV again over the gRPC stream: every
/// piece put through it is kept (shared, not copied) until the transfer ends, and layers are
/// put together into the whole blocks a stream carries. (Pieces copied into a pool mapped on
/// this host are not kept: a copy waits on no network.)
struct Fallback {
    remote: Option<Box<dyn KvSink>>,
    /// The one-sided transport's name.
    from: &'static str,
    kept: Vec<KvPiece>,
    stream: Option<(Box<dyn KvSink>, Assembler)>,
    grpc: Arc<GrpcTransport>,
    target: KvTarget,
    prefill_node: String,
    stats: Arc<TransferStats>,
    layout: KvLayout,
    /// The prompt's first blocks that travel thin (`KvLayout::thin_blocks`).
    thin: usize,
}

impl Fallback {
    async fn fall_back(&mut self, reason: String) -> Result<(), TransferError> {
        // Dropped: its session stays open until its puts are over, then ends.
        self.remote = None;
        self.stats.fallback(self.from, Fallen::Stalled);
        tracing::warn!(node = self.target.decode_node, "KV falls back to gRPC: {reason}");
        pdmesh_common::trace::event(
            &tracing::Span::current(),
            "kv.fallback",
            &[("from", self.from.into()), ("to", "grpc".into()), ("reason", reason)],
        );
        let mut sink = self.grpc.open(&self.target, &self.prefill_node).await?;
        let mut asm = Assembler::new(self.layout, self.thin);
        for p in std::mem::take(&mut self.kept) {
            asm.add(p).map_err(|reason| self.invalid(reason))?;
        }
        while let Some(p) = asm.next_run() {
            sink.send(p).await?;
        }
        self.stream = Some((sink, asm));
        Ok(())
    }

    fn invalid(&self, reason: String) -> TransferError {
        TransferError::Invalid { node: self.target.decode_node.clone(), reason }
    }
}

#[async_trait::async_trait]
impl KvSink for Fallback {
    fn transport(&self) -> &'static str {
        if self.stream.is_some() { "grpc" } else { self.from }
    }

    fn layered(&self) -> bool {
        true
    }

    fn mapped(&self) -> bool {
        self.remote.as_ref().is_some_and(|u| u.mapped())
    }

    async fn send(&mut self, piece: KvPiece) -> Result<(), TransferError> {
        if let Some((sink, asm)) = &mut self.stream {
            asm.add(piece).map_err(|reason| TransferError::Invalid {
                node: self.target.decode_node.clone(),
                reason,
            })?;
            while let Some(p) = asm.next_run() {
                sink.send(p).await?;
            }
            return Ok(());
        }
        let remote = self.remote.as_mut().expect("a one-sided sink until the fallback");
        // Copies into a pool mapped here do not wait on a network: nothing to send again.
        if !remote.mapped() {
            self.kept.push(piece.clone());
        }
        match remote.send(piece).await {
            Err(TransferError::Stalled { reason, resendable: true, .. }) => {
                self.fall_back(reason).await
            }
            r => r,
        }
    }

    async fn finish(
        mut self: Box<Self>,
        blocks: u32,
        checksums: Vec<u64>,
    ) -> Result<Finished, TransferError> {
        if let Some(remote) = self.remote.take() {
            match remote.finish(blocks, checksums.clone()).await {
                Err(TransferError::Stalled { reason, resendable: true, .. }) => {
                    self.fall_back(reason).await?;
                }
                r => return r,
            }
        }
        let (sink, asm) = self.stream.take().expect("the stream after a fallback");
        if asm.next < blocks as usize {
            return Err(self
                .invalid(format!("{} of {blocks} blocks were whole when the KV ended", asm.next)));
        }
        sink.finish(blocks, checksums).await
    }
}

/// Whole blocks (in their wire form: thin before `thin`), in order, from pieces of whole
/// blocks or of single layers.
#[derive(Debug)]
struct Assembler {
    layout: KvLayout,
    thin: usize,
    /// Blocks still missing layers: their bytes so far and how many layers arrived.
    partial: BTreeMap<usize, (Vec<u8>, usize)>,
    whole: BTreeMap<usize, Bytes>,
    /// The next block to hand on.
    next: usize,
}

/// Blocks per piece handed to the stream.
const RUN: usize = 4;

impl Assembler {
    fn new(layout: KvLayout, thin: usize) -> Self {
        Self { layout, thin, partial: BTreeMap::new(), whole: BTreeMap::new(), next: 0 }
    }

    fn add(&mut self, piece: KvPiece) -> Result<(), String> {
        let (first, thin, l) = (piece.first_block as usize, self.thin, &self.layout);
        let Some(layer) = piece.layer else {
            let blocks = l.split_wire(first, thin, &piece.data).filter(|b| !b.is_empty());
            let blocks = blocks.ok_or_else(|| {
                format!("{} bytes from block {first} are not whole blocks", piece.data.len())
            })?;
            let mut at = 0;
            for (i, b) in blocks.iter().enumerate() {
                self.whole.insert(first + i, piece.data.slice(at..at + b.len()));
                at += b.len();
            }
            return Ok(());
        };
        let layer = layer as usize;
        let layers = l.geometry.layers;
        if layer >= layers {
            return Err(format!("layer {layer} is past the model's {layers} layers"));
        }
        let unit = l.geometry.bytes_per_layer();
        if piece.data.is_empty() || !piece.data.len().is_multiple_of(unit) {
            return Err(format!("{} bytes are not whole units of {unit}", piece.data.len()));
        }
        for (i, part) in piece.data.chunks_exact(unit).enumerate() {
            let b = first + i;
            let at = l
                .wire_layer_offset(layer, b, thin)
                .ok_or_else(|| format!("thin block {b} travels without layer {layer}"))?;
            let size = l.wire_block_bytes(b, thin);
            let (buf, seen) = self.partial.entry(b).or_insert_with(|| (vec![0; size], 0));
            buf[at..at + unit].copy_from_slice(part);
            *seen += 1;
            if *seen * unit == size {
                let (buf, _) = self.partial.remove(&b).expect("just filled");
                self.whole.insert(b, Bytes::from(buf));
            }
        }
        Ok(())
    }

    /// The next run of whole blocks in order, if the next block is whole.
    fn next_run(&mut self) -> Option<KvPiece> {
        let first = self.next;
        let mut data = Vec::new();
        while data.len() < RUN * self.layout.bytes_per_block() {
            let Some(b) = self.whole.remove(&self.next) else { break };
            data.extend_from_slice(&b);
            self.next += 1;
        }
        (!data.is_empty()).then(|| KvPiece {
            first_block: first as u32,
            layer: None,
            data: data.into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdmesh_kv_types::{KvDtype, KvGeometry, KvWindow, LayerMask};

    /// `layers` layers of 4 bytes a block; `local` through a window.
    fn layout(layers: usize, local: Option<&[usize]>) -> KvLayout {
        let geometry =
            KvGeometry { layers, kv_heads: 1, head_dim: 1, block_size: 1, dtype: KvDtype::F16 };
        let window = local.map(|l| KvWindow {
            tokens: 2,
            local: LayerMask::from_layers(l.iter().copied()).unwrap(),
        });
        KvLayout { model_fingerprint: 1, geometry, window }
    }

    /// Before the cut a block is made of its global layers (1 and 2 of 0..3) and is whole
    /// once they came; a windowed layer's piece for it is refused, as is a torn thin block.
    #[test]
    fn thin_blocks_are_whole_with_their_global_layers() {
        let l = layout(3, Some(&[0]));
        let mut a = Assembler::new(l, 2);
        let piece = |first: u32, layer: Option<u32>, data: Vec<u8>| KvPiece {
            first_block: first,
            layer,
            data: data.into(),
        };
        a.add(piece(0, Some(2), vec![2; 8])).unwrap();
        assert!(a.add(piece(0, Some(0), vec![9; 4])).unwrap_err().contains("without layer 0"));
        assert!(a.next_run().is_none(), "layer 1 of blocks 0 and 1 is missing");
        a.add(piece(0, Some(1), vec![1; 8])).unwrap();
        a.add(piece(2, None, vec![7; 12])).unwrap();
        let run = a.next_run().unwrap();
        let thin = [vec![1; 4], vec![2; 4]].concat();
        assert_eq!(run.data.to_vec(), [thin.clone(), thin, vec![7; 12]].concat());
        let mut b = Assembler::new(l, 2);
        assert!(b.add(piece(0, None, vec![0; 12])).is_err(), "a whole-sized thin block");
        b.add(piece(0, None, vec![0; 16])).unwrap();
        assert_eq!(b.next_run().unwrap().data.len(), 16, "two thin blocks");
    }

    #[test]
    fn layers_in_any_order_make_whole_blocks_in_order() {
        let block = |b: u8| (0..8).map(|i| b * 16 + i).collect::<Vec<u8>>();
        let layer = |b: u8, l: usize| block(b)[l * 4..(l + 1) * 4].to_vec();
        let mut a = Assembler::new(layout(2, None), 0);
        let piece = |first: u32, layer: Option<u32>, data: Vec<u8>| KvPiece {
            first_block: first,
            layer,
            data: data.into(),
        };
        // Blocks 0 and 1, layer 1 first; then block 2 whole.
        a.add(piece(0, Some(1), [layer(0, 1), layer(1, 1)].concat())).unwrap();
        assert!(a.next_run().is_none(), "no block is whole yet");
        a.add(piece(2, None, block(2))).unwrap();
        assert!(a.next_run().is_none(), "block 2 waits for 0 and 1");
        a.add(piece(0, Some(0), [layer(0, 0), layer(1, 0)].concat())).unwrap();
        let run = a.next_run().unwrap();
        assert_eq!((run.first_block, run.layer), (0, None));
        assert_eq!(run.data.to_vec(), [block(0), block(1), block(2)].concat());
        assert!(a.next_run().is_none());
        assert!(a.add(piece(3, Some(2), vec![0; 4])).is_err(), "past the layers");
        assert!(a.add(piece(3, None, vec![0; 5])).is_err(), "not whole blocks");
    }
}
