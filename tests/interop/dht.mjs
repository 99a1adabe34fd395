// A js-libp2p Kademlia DHT server (@libp2p/kad-dht, /ipfs/kad/1.0.0) on 127.0.0.1, for tests/test_rendezvous.py: the
// independent implementation among the DHT servers that stand in for the public DHT.
//
// It listens on 127.0.0.1 only, dials only the peers it is given, and speaks TCP + Noise + yamux, as a public DHT
// server does. It prints one JSON line with its full multiaddr once listening, and runs until SIGTERM/SIGINT or
// its time limit.
//
//   node dht.mjs --seconds 300 [--peer /ip4/127.0.0.1/tcp/PORT/p2p/ID ...]
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
  options: { seconds: { type: 'string' }, peer: { type: 'string', multiple: true, default: [] } }
})
const seconds = Number(args.seconds)
if (!(seconds > 0)) {
  process.stdout.write(JSON.stringify({ event: 'error', message: '--seconds must be positive' }) + '\n')
  process.exit(2)
}

const node = await createLibp2p({
  addresses: { listen: ['/ip4/127.0.0.1/tcp/0'] },
  transports: [tcp()],
  connectionEncrypters: [noise()],
  streamMuxers: [yamux()],
  connectionGater: { denyDialMultiaddr: (ma) => !ma.toString().startsWith('/ip4/127.') },
  services: {
    identify: identify(),
    ping: ping(),
    // a server from the start (no waiting to learn it is public), and loopback addresses kept: the lab is 127.0.0.1
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
