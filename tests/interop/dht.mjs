// A js-libp2p Kademlia DHT server (@libp2p/kad-dht, /ipfs/kad/1.0.0) on 127.0.0.1, for tests/test_rendezvous.py: the
// independent implementation among the DHT servers that stand in for the public DHT.
//
// It listens on 127.0.0.1 (or the --listen address: a lab namespace's), dials only addresses on its own /8 (the
// peers it is given, those they name), and speaks TCP + Noise + yamux, as a public DHT server does. It prints one
// JSON line with its full multiaddr once listening, and runs until SIGTERM/SIGINT or its time limit.
//
//   node dht.mjs --seconds 300 [--listen /ip4/IP/tcp/PORT] [--peer /ip4/127.0.0.1/tcp/PORT/p2p/ID ...]
import './polyfill.mjs'
import { parseArgs } from 'node:util'
import { noise } from '@chainsafe/libp2p-noise'
import { yamux } from '@chainsafe/libp2p-yamux'
import { identify } from '@libp2p/identify'
import { kadDHT } from '@libp2p/kad-dht'
import { ping } from '@libp2p/ping'
import { tcp } from '@libp2p/tcp'
import { multiaddr } from '@multiformats/multiaddr'
import { createLibp2p } from 'libp2p'

const { values: args } = parseArgs({
  options: {
    seconds: { type: 'string' },
    listen: { type: 'string', default: '/ip4/127.0.0.1/tcp/0' },
    peer: { type: 'string', multiple: true, default: [] }
  }
})
const seconds = Number(args.seconds)
if (!(seconds > 0)) {
  process.stdout.write(JSON.stringify({ event: 'error', message: '--seconds must be positive' }) + '\n')
  process.exit(2)
}

const own = args.listen.split('/')[2].split('.')[0]  // the first octet of its address: the lab's, or loopback
const node = await createLibp2p({
  addresses: { listen: [args.listen] },
  transports: [tcp()],
  connectionEncrypters: [noise()],
  streamMuxers: [yamux()],
  connectionGater: { denyDialMultiaddr: (ma) => !ma.toString().startsWith(`/ip4/${own}.`) },
  services: {
    identify: identify(),
    ping: ping(),
    // a server from the start (no waiting to learn it is public), and private addresses kept: the lab's are
    dht: kadDHT({ protocol: '/ipfs/kad/1.0.0', clientMode: false, peerInfoMapper: (info) => info })
  }
})
for (const peer of args.peer) {
  await node.dial(multiaddr(peer))
}
process.stdout.write(JSON.stringify({ event: 'listening', addr: node.getMultiaddrs()[0].toString() }) + '\n')

const stop = async () => { await node.stop(); process.exit(0) }
process.on('SIGTERM', stop)
process.on('SIGINT', stop)
setTimeout(stop, seconds * 1000)
