"""Packing: many tensors of one dtype become a few flat chunks, and back.

An all-reduce of one big buffer costs one launch where fifty small ones cost fifty. A
`Packing` is planned once from the tensors' shapes: the tensors, flattened and laid end to
end, are cut into `num_packs` chunks of near-equal size. Each device then packs its own
tensors, the chunks are all-reduced like tensors, and each device unpacks its results.

Each chunk is made by one concatenation of the (flattened) tensors it holds, and unpacked
by one split, so a byte is copied once each way; only a tensor cut by a chunk boundary is
sliced (packing) or joined (unpacking) once more.
"""

from diststrat._tf import tf


def fully_defined(tensors):
  """True when every tensor's static shape is fully known (packing needs the sizes)."""
  return all(t.shape.is_fully_defined() for t in tensors)


class Packing:
  """How to cut tensors of the given shapes into `num_packs` flat chunks of near-equal size.

  Example:
    >>> import tensorflow as tf
    >>> p = Packing([[2, 3], [4]], num_packs=2)
    >>> chunks = p.pack([tf.ones([2, 3]), tf.zeros([4])])
    >>> [c.shape.as_list() for c in chunks]
    [[5], [5]]
    >>> [t.shape.as_list() for t in p.unpack(chunks)]
    [[2, 3], [4]]
  """

  def __init__(self, shapes, num_packs):
    self._shapes = [tf.TensorShape(s) for s in shapes]
    self._sizes = [s.num_elements() for s in self._shapes]
    total = sum(self._sizes)
    count = max(1, min(num_packs, total))
    base, extra = divmod(total, count)
    # segments[c]: the (tensor index, offset, length) pieces that chunk c holds, in order.
    self._segments = []
    pieces = ((j, size) for j, size in enumerate(self._sizes) if size)
    j, left, offset = None, 0, 0
    for c in range(count):
      room = base + (1 if c < extra else 0)
      segments = []
      while room:
        if not left:
          j, left = next(pieces)
          offset = 0
        take = min(room, left)
        segments.append((j, offset, take))
        offset, left, room = offset + take, left - take, room - take
      self._segments.append(segments)

  @property
  def num_chunks(self):
    return len(self._segments)

  def pack(self, tensors):
    """The tensors (one device's, in plan order), flattened and cut into chunks."""
    flat = [tf.reshape(t, [-1]) for t in tensors]
    chunks = []
    for segments in self._segments:
      pieces = [flat[j] if length == self._sizes[j] else flat[j][offset:offset + length]
                for j, offset, length in segments]
      chunks.append(pieces[0] if len(pieces) == 1 else tf.concat(pieces, axis=0))
    return chunks

  def unpack(self, chunks):
    """The inverse of `pack`: the chunks (one device's) back as tensors of the plan's shapes."""
    parts = [[] for _ in self._sizes]
    for chunk, segments in zip(chunks, self._segments, strict=True):
      pieces = [chunk] if len(segments) == 1 else tf.split(chunk, [s[2] for s in segments])
      for (j, _, _), piece in zip(segments, pieces, strict=True):
        parts[j].append(piece)
    tensors = []
    for pieces, shape in zip(parts, self._shapes, strict=True):
      if not pieces:  # An empty tensor holds no elements of any chunk.
        tensors.append(tf.zeros(shape, chunks[0].dtype))
      else:
        tensors.append(tf.reshape(pieces[0] if len(pieces) == 1 else tf.concat(pieces, 0),
                                  shape))
    return tensors


def bucket_plan(tensors, bucket_bytes):
  """Groups tensors, in order, into buckets of one dtype of at most `bucket_bytes` each.

  A tensor of unknown shape, with no element, or larger than `bucket_bytes` is a bucket
  of its own; `bucket_bytes=None` makes every tensor its own bucket. The plan depends
  only on the tensors' shapes, dtypes and order, so every process plans the same.

  Returns:
    Lists of indices into `tensors`, ordered by their first index.

  Example:
    >>> import tensorflow as tf
    >>> bucket_plan([tf.zeros([100]), tf.zeros([3], tf.int32), tf.zeros([200]),
    ...              tf.zeros([900])], bucket_bytes=1200)
    [[0, 2], [1], [3]]
  """
  buckets, open_bucket = [], {}  # open_bucket: dtype -> (bucket, bytes in it)
  for i, t in enumerate(tensors):
    size = t.shape.num_elements() if t.shape.is_fully_defined() else None
    nbytes = None if size is None else size * t.dtype.size
    if bucket_bytes is None or not nbytes or nbytes > bucket_bytes:
      buckets.append([i])
      continue
    bucket, used = open_bucket.get(t.dtype, (None, 0))
    if bucket is None or used + nbytes > bucket_bytes:
      bucket, used = [], 0
      buckets.append(bucket)
    bucket.append(i)
    open_bucket[t.dtype] = (bucket, used + nbytes)
  return buckets
