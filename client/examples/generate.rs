//! Connect to leanstreamd, open a session, stream one generation, print its stats.
//!
//! cargo run -p leanstream --example generate -- [--bus system|session|ADDRESS] [--model NAME] PROMPT

use std::io::Write;

use leanstream::contract::GenerateParams;
use leanstream::{Bus, Client};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut bus = Bus::System;
    let mut model = "smollm2".to_owned();
    let mut prompt = "A robot that can fold laundry".to_owned();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--bus" => bus = args.next().ok_or("--bus needs a value")?.parse()?,
            "--model" => model = args.next().ok_or("--model needs a value")?,
            _ => prompt = arg,
        }
    }

    let client = Client::connect(&bus).await?;
    println!(
        "leanstreamd {} on {}",
        client.version().await?,
        client.backend().await?
    );
    let session = client.open_session(&model, 0).await?;
    let params = GenerateParams {
        max_tokens: 64,
        ..GenerateParams::default()
    };
    let stream = session.generate(&prompt, &params).await?;
    let generation = stream
        .finish_with(|text| {
            print!("{text}");
            let _ = std::io::stdout().flush();
        })
        .await?;
    let s = &generation.stats;
    println!(
        "\n[{} tokens, stop: {}, first token after {:.2} s, {:.1} tokens/s]",
        s.generated_tokens, generation.reason, s.time_to_first_token_s, s.decode_tokens_per_s
    );
    println!("{:?}", session.stats().await?);
    session.close().await?;
    Ok(())
}
