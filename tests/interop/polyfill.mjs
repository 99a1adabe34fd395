// js-libp2p 3.x calls Promise.withResolvers, native only from Node 22; Debian's Node 20 lacks it.
// peer.mjs imports this module before anything from libp2p, so it is defined first.
if (typeof Promise.withResolvers !== 'function') {
  Promise.withResolvers = function withResolvers () {
    let resolve, reject
    const promise = new this((res, rej) => { resolve = res; reject = rej })
    return { promise, resolve, reject }
  }
}
