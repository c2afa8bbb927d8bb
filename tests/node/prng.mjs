// A deterministic pseudo-random generator for the Node tests and the soak test, so that a
// failing run can be repeated from its seed (Node built-ins only).

/** mulberry32: returns a function giving uniform floats in [0, 1) from a 32-bit seed. */
export function rng(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}
